"""Performance benchmarks of ssl_engine against hand-written PyTorch loops (not tests).

Run them with ``make bench`` (``python benchmarks/run_all.py``); benchmarks/README.md describes
every workload and keeps the latest table. Every figure is a ratio to a plain loop doing the same
work in the same process run, so that it holds on a busy machine.
"""
