"""A small xLSTM language model (the xLSTM-7B block order) on compileops.nn.mLSTMLayer,
compiled whole and trained for a few steps.

Each block: ``x + mLSTMLayer(RMSNorm(x))``, then ``x + SwiGLU(RMSNorm(x))``; an embedding in
front, a final RMSNorm and a soft-capped LM head behind (xlstm's ``xLSTMLarge``; the module
and parameter names follow it, so ``model.state_dict()`` has xlstm's keys). Inside each
layer the mLSTM cell and its multi-head layernorm are one op (``compileops.mlstm`` with the
norm's weight), and the output gate ``sigmoid(o) * h`` follows it.

Shows: ``torch.compile(model, fullgraph=True)`` over the whole model, forward and backward,
with no graph break; AdamW on random tokens, printing the loss (it falls as the model
memorises the batch).

    python examples/xlstm_block.py                  # CPU, tiny (Triton's interpreter)
    python examples/xlstm_block.py --device cuda    # bf16 autocast, realistic widths
    python examples/xlstm_block.py --device cuda --dim 2048 --heads 8 --blocks 4 --seq 2048
    python examples/xlstm_block.py --device cuda --long-seq 65536 --generate 32

After training it greedy-decodes ``--generate`` tokens: one chunkwise pass over a prompt
returns each layer's state, then ``compileops.mlstm_step`` runs one token at a time, checked
against the full forward. ``--long-seq`` adds one compiled forward+backward at that length.

On CPU the mLSTM kernels run under Triton's interpreter (``--backend reference`` uses the
plain-PyTorch path instead); keep the sizes small there. The Triton kernels take a query
head (``qk_factor * dim / heads``) up to 256 wide, and value heads (``v_factor * dim / heads``)
of any width.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class RMSNorm(torch.nn.Module):
    """``x / rms(x) * weight`` over the last dim, statistics in fp32 (as xlstm's RMSNorm)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps)
        return y.to(x.dtype) * self.weight.to(x.dtype)


class FeedForward(torch.nn.Module):
    """SwiGLU: ``proj_down(silu(proj_up_gate(x)) * proj_up(x))``, hidden width ``~8/3 dim``
    rounded up to a multiple of 64 (xlstm's ``FeedForward``, single weight mode)."""

    def __init__(self, dim: int, factor: float = 2.6667, multiple_of: int = 64):
        super().__init__()
        hidden = -(-int(dim * factor) // multiple_of) * multiple_of
        self.proj_up_gate = torch.nn.Linear(dim, hidden, bias=False)
        self.proj_up = torch.nn.Linear(dim, hidden, bias=False)
        self.proj_down = torch.nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj_down(torch.nn.functional.silu(self.proj_up_gate(x)) * self.proj_up(x))


class mLSTMBlock(torch.nn.Module):  # noqa: N801  (xlstm's name)
    """``[B, S, D] -> [B, S, D]``: the xLSTM-7B block order."""

    def __init__(self, config):
        import compileops

        super().__init__()
        dim = config.embedding_dim
        self.norm_mlstm = RMSNorm(dim, config.norm_eps)
        self.mlstm_layer = compileops.nn.mLSTMLayer(config)
        self.norm_ffn = RMSNorm(dim, config.norm_eps)
        self.ffn = FeedForward(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mlstm_layer(self.norm_mlstm(x))
        return x + self.ffn(self.norm_ffn(x))

    def prefill(self, x: torch.Tensor):
        y, state = self.mlstm_layer.prefill(self.norm_mlstm(x))
        x = x + y
        return x + self.ffn(self.norm_ffn(x)), state

    def step(self, x: torch.Tensor, state):
        """``x [B, D]``, one token, with the layer's recurrent state."""
        y, state = self.mlstm_layer.step(self.norm_mlstm(x), state)
        x = x + y
        return x + self.ffn(self.norm_ffn(x)), state


class BlockStack(torch.nn.Module):
    def __init__(self, config, num_blocks: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList(mLSTMBlock(config) for _ in range(num_blocks))
        self.out_norm = RMSNorm(config.embedding_dim, config.norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.out_norm(x)

    def prefill(self, x: torch.Tensor):
        states = []
        for block in self.blocks:
            x, state = block.prefill(x)
            states.append(state)
        return self.out_norm(x), states

    def step(self, x: torch.Tensor, states):
        new = []
        for block, state in zip(self.blocks, states):
            x, state = block.step(x, state)
            new.append(state)
        return self.out_norm(x), new


class xLSTMLM(torch.nn.Module):  # noqa: N801
    """ids ``[B, S]`` -> logits ``[B, S, vocab]``, soft-capped at ``logit_cap``."""

    def __init__(self, vocab: int, config, num_blocks: int, logit_cap: float = 30.0):
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab, config.embedding_dim)
        self.backbone = BlockStack(config, num_blocks)
        self.lm_head = torch.nn.Linear(config.embedding_dim, vocab, bias=False)
        self.logit_cap = logit_cap

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.logits(self.backbone(self.embedding(ids)))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(x)
        return self.logit_cap * torch.tanh(logits / self.logit_cap)

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, new_tokens: int):
        """Greedy decoding: the prompt ``[B, P]`` in one chunkwise pass that returns each
        layer's state, then one token at a time on ``compileops.mlstm_step``. Returns the ids
        ``[B, P + new_tokens]`` and the logits of every generated position."""
        x, states = self.backbone.prefill(self.embedding(prompt))
        logits = self.logits(x[:, -1])
        ids, seen = [prompt], []
        for _ in range(new_tokens):
            seen.append(logits)
            token = logits.argmax(-1)
            ids.append(token[:, None])
            x, states = self.backbone.step(self.embedding(token), states)
            logits = self.logits(x)
        return torch.cat(ids, 1), torch.stack(seen, 1)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--backend", choices=("auto", "reference"), default="auto",
                        help="mLSTM eager backend: auto (Triton; the interpreter on CPU) or "
                             "the plain-PyTorch reference")
    parser.add_argument("--dim", type=int, help="embedding dim (CPU 32, CUDA 1024)")
    parser.add_argument("--heads", type=int, help="heads (CPU 2, CUDA 4)")
    parser.add_argument("--blocks", type=int, help="blocks (CPU 2, CUDA 4)")
    parser.add_argument("--seq", type=int, help="sequence length (CPU 16, CUDA 1024)")
    parser.add_argument("--batch", type=int, help="batch size (CPU 2, CUDA 8)")
    parser.add_argument("--vocab", type=int, help="vocabulary size (CPU 64, CUDA 32000)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--generate", type=int, default=8,
                        help="after training, greedy-decode this many tokens on mlstm_step "
                             "and check them against the full forward")
    parser.add_argument("--long-seq", type=int, default=0,
                        help="then one compiled forward+backward at this length (kernel="
                             "'auto' takes the chunkwise form), with its time and peak memory")
    args = parser.parse_args(argv)

    on_gpu = args.device.startswith("cuda")
    if on_gpu and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available on this machine")
    if not on_gpu and args.backend == "auto":
        # Before compileops defines its kernels: they run on CPU tensors under the interpreter.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import compileops

    defaults = dict(dim=1024, heads=4, blocks=4, seq=1024, batch=8, vocab=32000) if on_gpu \
        else dict(dim=32, heads=2, blocks=2, seq=16, batch=2, vocab=64)
    size = {k: getattr(args, k) if getattr(args, k) is not None else v
            for k, v in defaults.items()}
    device = torch.device(args.device)
    torch.manual_seed(0)

    config = compileops.nn.mLSTMLayerConfig(embedding_dim=size["dim"], num_heads=size["heads"])
    model = xLSTMLM(size["vocab"], config, size["blocks"]).to(device)
    params = sum(p.numel() for p in model.parameters())
    dqk, dv = config.qk_dim // config.num_heads, config.v_dim // config.num_heads
    backend = (compileops.backends.select("mlstm_parallel", device) if args.backend == "auto"
               else "reference")
    print(f"xLSTM LM: {size['blocks']} blocks, dim {size['dim']}, {size['heads']} heads "
          f"(DQK {dqk}, DV {dv}), vocab {size['vocab']}, {params / 1e6:.2f}M parameters, "
          f"{device}, mLSTM eager backend {backend}")

    compiled = torch.compile(model, fullgraph=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    ids = torch.randint(0, size["vocab"], (size["batch"], size["seq"] + 1), device=device)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=on_gpu)
    forced = compileops.use_backend("reference") if args.backend == "reference" else None

    def step() -> float:
        with autocast:
            logits = compiled(inputs)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                 targets.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss.item()

    for i in range(args.steps):
        start = time.perf_counter()
        if forced is not None:
            with forced:
                loss = step()
        else:
            loss = step()
        if on_gpu:
            torch.cuda.synchronize(device)
        note = " (includes compiling)" if i == 0 else ""
        print(f"step {i}: loss {loss:.4f}  {1e3 * (time.perf_counter() - start):.1f} ms{note}")

    if args.generate:
        prompt = inputs[:, : max(1, size["seq"] // 2)]
        with autocast:
            ids_out, step_logits = model.generate(prompt, args.generate)
            with torch.no_grad():
                full = model(ids_out[:, :-1])[:, prompt.shape[1] - 1:]
        gap = (step_logits.float() - full.float()).abs().max().item()
        same = bool((step_logits.argmax(-1) == full.argmax(-1)).all())
        print(f"generated {args.generate} tokens on mlstm_step after a {prompt.shape[1]}-token "
              f"chunkwise prefill: logits within {gap:.2e} of the full forward, same greedy "
              f"tokens: {same}")

    if args.long_seq:
        from compileops.mlstm.api import choose_kernel

        long_ids = torch.randint(0, size["vocab"], (1, args.long_seq + 1), device=device)
        if on_gpu:
            torch.cuda.reset_peak_memory_stats(device)
        for attempt in range(2):  # the first compiles for the new length
            start = time.perf_counter()
            with autocast:
                logits = compiled(long_ids[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                     long_ids[0, 1:])
            loss.backward()
            optimizer.zero_grad(set_to_none=True)
            if on_gpu:
                torch.cuda.synchronize(device)
        peak = f", peak {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB" if on_gpu \
            else ""
        print(f"long sequence S={args.long_seq}: forward+backward "
              f"{1e3 * (time.perf_counter() - start):.1f} ms{peak} (kernel='auto': "
              f"{choose_kernel('auto', args.long_seq, True)})")


if __name__ == "__main__":
    main()
