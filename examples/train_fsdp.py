"""Shim: runs fsdpprof's packaged example (fsdpprof/examples/train_fsdp.py) with the same arguments."""
import runpy

if __name__ == "__main__":
    runpy.run_module("fsdpprof.examples.train_fsdp", run_name="__main__", alter_sys=True)
