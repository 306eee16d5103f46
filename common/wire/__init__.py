"""The wire: the safetensors protocol between the trainer, the workers and the ref server (docs/protocol.md),
its typed batches and their `extra` tensors, and the HTTP client that speaks it (`client.py`).
"""
