"""A toy reward that a random tiny model can learn in a few dozen steps (used by the e2e tests).

Loaded by the trainer as the dotted path "toy_rewards:digit_fraction" with tests/ on PYTHONPATH,
which also exercises the pluggable-reward path.
"""


def digit_fraction(completion: str, ground_truth: str) -> float:
    """Share of the completion's non-space characters that are ASCII digits, in [0, 1]."""
    chars = [c for c in completion if not c.isspace()]
    return sum("0" <= c <= "9" for c in chars) / len(chars) if chars else 0.0


def char_variety(completion: str, ground_truth: str) -> float:
    """Distinct characters over characters, in (0, 1]: differs between almost any two sampled completions of a
    random model, so a run with it trains every step whatever the sampler's random stream draws (digit_fraction
    can be 0 for a whole step of a random model)."""
    return len(set(completion)) / len(completion) if completion else 0.0
