// Python module `lss._C`: loading it registers every op of the `lss` torch library.
#include <Python.h>

#include <string>

namespace {

PyObject* has_cuda(PyObject*, PyObject*) {
#ifdef LSS_WITH_CUDA
  Py_RETURN_TRUE;
#else
  Py_RETURN_FALSE;
#endif
}

PyObject* cuda_archs(PyObject*, PyObject*) {
#ifdef LSS_CUDA_ARCHS
  return PyUnicode_FromString(LSS_CUDA_ARCHS);
#else
  return PyUnicode_FromString("");
#endif
}

PyMethodDef methods[] = {
    {"has_cuda", has_cuda, METH_NOARGS, "Whether the CUDA kernels were compiled into this build."},
    {"cuda_archs", cuda_archs, METH_NOARGS, "TORCH_CUDA_ARCH_LIST the CUDA kernels were compiled for."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "lss custom ops (registered in torch.ops.lss)", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&module); }
