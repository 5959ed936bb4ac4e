"""Where AOTInductor on CUDA fails: a plain torch model first (no compileops), then one
compileops family, each step printed before it runs.

    python3 -X faulthandler benchmarks/tuning/probe_aoti.py plain|embedding|...
"""
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def step(msg):
    print(f"[aoti] {msg}", flush=True)


def main(which, device="cuda", mode="all", path=None, embed=False):
    """``mode``: ``all`` (compile, load, run here), ``compile`` (print the package path), or
    ``load`` (load ``path`` in this fresh process and run it)."""
    if mode == "load":
        runner = torch._inductor.aoti_load_package(path)
        step("loaded")
        out = runner(torch.randn(8, 64, device=device))
        step(f"ran: {type(out)}")
        return
    d = tempfile.mkdtemp()
    if which == "plain":
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()).to(device)
        inputs = (torch.randn(8, 64, device=device),)
        ep = torch.export.export(model, inputs)
    else:
        from tests import test_export as t
        model = t.make_module(which, "cuda")
        ep = t.export(model, which, "cuda", strict=False)
        inputs = t.make_inputs(which, *t.SHAPES[0], "cuda", seed=0)
    step("exported")
    configs = {"aot_inductor.embed_kernel_binary": True} if embed else None
    path = torch._inductor.aoti_compile_and_package(ep, package_path=os.path.join(d, "m.pt2"),
                                                   inductor_configs=configs)
    step(f"compiled {path}")
    if mode == "compile":
        print(path)
        return
    runner = torch._inductor.aoti_load_package(path)
    step("loaded")
    with torch.no_grad():
        out = runner(*inputs)
    if device == "cuda":
        torch.cuda.synchronize()
    step(f"ran: {type(out)}")


if __name__ == "__main__":
    main(sys.argv[1], *(sys.argv[2:3] or ["cuda"]), *(sys.argv[3:4] or ["all"]),
         *(sys.argv[4:5] or [None]), embed=os.environ.get("EMBED") == "1")
