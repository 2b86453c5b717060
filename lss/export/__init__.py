"""Deployment: the segmentation network to ONNX (`lss export`), checked against PyTorch in
onnxruntime."""

from lss.export.exporter import export_checkpoint, export_model

__all__ = ["export_checkpoint", "export_model"]
