"""Pixels in: image loading and the image processors (ViT, DeiT, BiT/DINOv2, CLIP, SigLIP), through PIL as
transformers does it. Sits beside tokenization: it imports only core."""

from flodl_hf.vision.processor import PROCESSOR_FILE, AutoImageProcessor, ImageProcessor

__all__ = ["PROCESSOR_FILE", "AutoImageProcessor", "ImageProcessor"]
