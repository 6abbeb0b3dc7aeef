"""Wire formats: request bytes -> tensors (zero-copy views where the format allows) and
results -> response bytes. JSON with base64 tensors, and safetensors; parsed here, strictly."""
