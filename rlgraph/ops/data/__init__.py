"""Data: where the prompts of a run come from.

`prompts` holds the data source's body (`PromptSource`: verl-layout parquet or JSONL, read
locally or through Ray Data, checked, filtered, shuffled and resumed), `tasks` the built-in
toy tasks that write such files (and the rows the examples' warm starts train on).
"""
