"""The LoRA wing (lora_r > 0). `adapters.py` wraps the policy through PEFT, names and ships its adapter
tensors, merges them into a worker's base weights (`LoraMerger`) and saves adapter and merged checkpoints;
`sync.py` is the worker side of adapter-only weight sync into an engine (every tensor of a fused vLLM layer
an adapter touches, W0 read from the base checkpoint).
"""
