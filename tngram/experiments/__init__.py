"""`tngram compare` (Table 1): runs launched as subprocesses (python or torchrun) on a resolved
config JSON, so each has clean process/distributed state; finished runs are reused, unfinished
ones resumed. The lab's experiments (research/experiments) build on the same runner.
"""
