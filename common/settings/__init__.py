"""The configuration machinery behind `common/config.py`: documented fields and loading (`knobs.py`), the
shared argument parser (`cli.py`), TRL's names (`trl_aliases.py`), the --help sections (`sections.py`) and the
model loading options (`model_options.py`).
"""
