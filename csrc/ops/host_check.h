// LSS_HOST_CHECK: TORCH_CHECK for the host-compiled argument checks (csrc/ops/*.cpp, cpu/*.cpp), with the message
// built by this header's own formatting instead of c10::str. The nvcc-compiled objects instantiate c10::str's
// templates for the same argument lists (torch's headers use them), and the linker keeps one copy of each: on a
// CUDA build a failed check then crashed inside c10::str instead of raising (common.h). Never include this header
// from a .cu file: its templates must be instantiated by the host compiler only.
#pragma once

#include <ATen/ATen.h>
#include <c10/macros/Macros.h>

#include <cstdio>
#include <string>
#include <string_view>
#include <type_traits>

#include "ops/common.h"

namespace lss {
namespace host {

inline void append(std::string& out, const char* s) { out += s; }
inline void append(std::string& out, const std::string& s) { out += s; }
inline void append(std::string& out, std::string_view s) { out.append(s.data(), s.size()); }
inline void append(std::string& out, at::IntArrayRef sizes) { out += shape_string(sizes); }
inline void append(std::string& out, c10::ScalarType t) { out += c10::toString(t); }
inline void append(std::string& out, const c10::Device& d) { out += d.str(); }
inline void append(std::string& out, bool b) { out += b ? "true" : "false"; }
inline void append(std::string& out, double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  out += buf;
}
template <typename T, typename = std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>>>
void append(std::string& out, T v) {
  out += std::to_string(v);
}
// Other character views (c10::string_view where it is not std::string_view).
template <typename S, typename = std::enable_if_t<
                          !std::is_convertible_v<const S&, std::string_view> &&
                          std::is_same_v<std::remove_cv_t<std::remove_pointer_t<
                                             decltype(std::declval<const S&>().data())>>,
                                         char>>>
void append(std::string& out, const S& s) {
  out.append(s.data(), s.size());
}

template <typename... Args>
std::string message(const Args&... args) {
  std::string out;
  (append(out, args), ...);
  return out;
}

}  // namespace host
}  // namespace lss

#define LSS_HOST_CHECK(cond, ...)                               \
  do {                                                          \
    if (C10_UNLIKELY(!(cond))) {                                \
      ::lss::raise_error(::lss::host::message(__VA_ARGS__));    \
    }                                                           \
  } while (false)
