"""A host-side KV-cache runner over static graphs, doing what Genie does on the phone.

The cache (CL entries per layer) lives outside the graph. Each step feeds the first CL-N cache slots
as `past_*_in`, the graph returns only the N new K/V entries, and the runner writes them at n_past.
Prompts run in AR-N chunks (the last one padded), generation in AR-1 steps. Any graph implementation
works (torch module, onnxruntime session, quantsim) through `GraphFn`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..shape import DecoderSpec
from .decoder import StaticDecoder, io_names

GraphFn = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def rope_tables(inv_freq: torch.Tensor, positions: Sequence[int], scaling: float = 1.0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(1,1,N,hd/2) cos/sin tables, computed as transformers does (float32)."""
    pos = torch.tensor(list(positions), dtype=torch.float32)
    ang = pos[:, None] * inv_freq.float()[None, :]
    return (ang.cos() * scaling)[None, None], (ang.sin() * scaling)[None, None]


class TorchGraph:
    """A StaticDecoder called with Genie's named feeds, returning named outputs."""

    def __init__(self, model: StaticDecoder) -> None:
        self.model = model
        self.ins, self.outs = io_names(model.spec.layers, model.extra_inputs)
        self.device = device_of(model)

    @torch.inference_mode()
    def __call__(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = self.model(*(feeds[n].to(self.device) for n in self.ins))
        return dict(zip(self.outs, out, strict=True))


def device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


@dataclass
class Cache:
    """The filled entries of a runner's cache: where one graph hands over to the next."""

    n_past: int
    k: list[torch.Tensor]  # per layer (kv_heads, 1, head_dim, n_past)
    v: list[torch.Tensor]  # per layer (kv_heads, 1, n_past, head_dim)


class KVCacheRunner:
    def __init__(self, spec: DecoderSpec, cl: int, graphs: dict[int, GraphFn], inv_freq: torch.Tensor,
                 device: torch.device | str = "cpu") -> None:
        if not graphs:
            raise ValueError("need at least one graph")
        self.spec, self.cl, self.graphs, self.inv_freq = spec, cl, graphs, inv_freq
        self.device = torch.device(device)  # where the cache lives: the graphs' device
        self.ar_prompt = max(graphs)
        self.extra: dict[str, torch.Tensor] = {}  # inputs every step takes as they are (an adapter's weights)
        self.reset()

    @classmethod
    def over(cls, model: torch.nn.Module, ar: int, cl: int, inv_freq: torch.Tensor) -> KVCacheRunner:
        """One module serving both the AR-`ar` prompt graph and the AR-1 token graph (they share weights)."""
        graph = TorchGraph(model)  # type: ignore[arg-type]
        return cls(model.spec, cl, {ar: graph, 1: graph}, inv_freq, graph.device)  # type: ignore[arg-type]

    def reset(self) -> None:
        s = self.spec
        self.n_past = 0
        self.k = [torch.zeros(s.kv_heads, 1, s.head_dim, self.cl, device=self.device) for _ in range(s.layers)]
        self.v = [torch.zeros(s.kv_heads, 1, self.cl, s.head_dim, device=self.device) for _ in range(s.layers)]

    def snapshot(self) -> Cache:
        """A copy of the cache's filled entries."""
        n = self.n_past
        return Cache(n, [k[:, :, :, :n].cpu().clone() for k in self.k], [v[:, :, :n, :].cpu().clone() for v in self.v])

    def resume(self, cache: Cache) -> None:
        """Go on from `cache` (another runner's snapshot, over other graphs of the same model)."""
        self.reset()
        n = self.n_past = cache.n_past
        for i in range(self.spec.layers):
            self.k[i][:, :, :, :n] = cache.k[i]
            self.v[i][:, :, :n, :] = cache.v[i]

    def release(self) -> None:
        """Let the cache go (a stage's memory peak may come after the runner's last use); `reset` makes a new one."""
        self.n_past, self.k, self.v = 0, [], []

    def feeds(self, tokens: Sequence[int], ar: int) -> dict[str, torch.Tensor]:
        """Inputs of one step: `tokens` (≤ ar) padded to ar, mask and RoPE for positions n_past.."""
        n, cl, p = len(tokens), self.cl, self.n_past
        if not 0 < n <= ar:
            raise ValueError(f"{n} tokens do not fit a step of AR-{ar}")
        if p + ar > cl:
            raise ValueError(f"context full: {p} cached + AR-{ar} step > CL {cl}")
        ids = torch.zeros(1, ar, dtype=torch.int32)
        ids[0, :n] = torch.tensor(list(tokens), dtype=torch.int32)
        mask = torch.full((1, 1, ar, cl), self.spec.mask_value)
        mask[0, 0, :, :p] = 0.0  # every row sees the cache
        new = torch.ones(ar, ar).tril()  # causal among the new entries, which sit at columns CL-ar..
        new[n:] = torch.eye(ar)[n:]  # padded rows see only themselves (keeps softmax finite)
        mask[0, 0, :, cl - ar:] = torch.where(new > 0, 0.0, self.spec.mask_value)
        cos, sin = rope_tables(self.inv_freq, range(p, p + ar), self.spec.rope_attention_scaling)
        f = {k: v.to(self.device) for k, v in (("input_ids", ids), ("attention_mask", mask),
                                                ("position_ids_cos", cos), ("position_ids_sin", sin))}
        for i in range(self.spec.layers):
            f[f"past_key_{i}_in"] = self.k[i][:, :, :, : cl - ar]
            f[f"past_value_{i}_in"] = self.v[i][:, :, : cl - ar, :]
        f.update((k, v.to(self.device)) for k, v in self.extra.items())
        return f

    def step(self, tokens: Sequence[int], ar: int | None = None) -> torch.Tensor:
        """Run one step and commit its KV; returns the logits of the real (unpadded) tokens (n, V)."""
        ar = ar or (1 if len(tokens) == 1 and 1 in self.graphs else self.ar_prompt)
        n, p = len(tokens), self.n_past
        out = self.graphs[ar](self.feeds(tokens, ar))
        for i in range(self.spec.layers):
            self.k[i][:, :, :, p:p + n] = out[f"past_key_{i}_out"][:, :, :, :n]
            self.v[i][:, :, p:p + n, :] = out[f"past_value_{i}_out"][:, :, :n, :]
        self.n_past += n
        return out["logits"][0, :n].float().cpu()

    def prefill(self, tokens: Sequence[int]) -> torch.Tensor:
        """Logits of every token of `tokens`, run in AR-N chunks."""
        n = self.ar_prompt
        return torch.cat([self.step(tokens[i:i + n], n) for i in range(0, len(tokens), n)])

    def logits(self, tokens: Sequence[int], decode_tokens: int = 0) -> torch.Tensor:
        """Teacher-forced logits for all tokens: AR-N prefill of the head, then AR-1 steps for the tail."""
        t = min(decode_tokens, len(tokens) - 1) if 1 in self.graphs else 0
        head, tail = list(tokens[: len(tokens) - t]), list(tokens[len(tokens) - t:])
        parts = [self.prefill(head)] + [self.step([tok], 1) for tok in tail]
        return torch.cat(parts)

    def score(self, tokens: Sequence[int], decode_tokens: int = 0) -> torch.Tensor:
        """`logits` from an empty cache: one eval window or calibration sequence."""
        self.reset()
        return self.logits(tokens, decode_tokens)

    def generate(self, prompt: Sequence[int], max_new: int, eos: Sequence[int] = (),
                 on_token: Callable[[int], None] | None = None) -> list[int]:
        """Greedy generation (the equivalence and preview path; Genie samples with its own sampler)."""
        last = self.prefill(list(prompt))[-1]
        out: list[int] = []
        for _ in range(max_new):
            tok = int(last.argmax())
            out.append(tok)
            if on_token:
                on_token(tok)
            if tok in eos or self.n_past + 1 > self.cl:
                break
            last = self.step([tok], 1)[-1]
        return out
