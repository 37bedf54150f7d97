"""minillm's benchmarks: what writes the records in `benchmarks/results/` and serves the project's
own history. Not part of the installed package; run from the checkout's top folder:

    python -m benchmarks NAME|all [--quick] [--device cpu|cuda] [--out DIR]

(`__main__.py` lists the names). Each benchmark imports the instruments of `minillm.lab` and
writes its record through `records.write_result`; `results_table` turns the records into the
results table (docs/results.md), `gpu_run` is the one prepared script for a borrowed GPU, and
`baseline` times the engine of an earlier commit beside this one.
"""
