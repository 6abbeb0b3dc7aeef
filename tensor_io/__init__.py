"""Tensors as bytes, beneath every other package: zero-copy byte views of tensors
(`tensor_io.views`), the one shape check of every decoder (`tensor_io.shapes`) and the one
safetensors implementation (`tensor_io.safetensors_format`), with its header caps.

Imports torch and numpy only, so the pool (`state_store`), the server (`service`) and the
client (`kda_client`) all use it without importing one another.
"""
