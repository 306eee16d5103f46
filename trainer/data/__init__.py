"""The data wing: rows in, prompts out. `loading.py` turns rows (hub datasets, local files and folders, synthetic
tasks) into examples and samples prompts from them in shards; `files.py` reads one data file (.jsonl and .json,
either gzipped; .csv; .parquet) and finds a folder's split; `example.py` is the `Example` every loader returns;
`prompt_formats.py` turns an example's prompt into the text the policy continues (`prompt_format`);
`run_data.py` is what one run trains and evaluates on, checked against its reward functions.
"""
