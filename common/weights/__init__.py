"""The weight path: how the policy's weights travel from rank 0 to the workers. `blob.py` is the safetensors
blob (named parameters, tied weights once) and `checksum.py` its XXH3-64 checksum; `delta.py` encodes what
changed since a version, `kernels.py` holds its compiled scan and apply loops and `apply.py` checks and applies
a delta; `sync.py` is the client side of publish and fetch through the ref server.
"""
