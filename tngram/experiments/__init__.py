"""Experiments: `tngram compare` (Table 1) and one command per figure of the paper.

Runs are launched as subprocesses (python or torchrun) on a resolved config JSON, so each run
has clean process/distributed state; finished runs are reused, unfinished ones resumed.
"""
