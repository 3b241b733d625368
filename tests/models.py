"""Small real-architecture models for engine tests (no dependency on transformers)."""

from __future__ import annotations

import functools
import math
import threading
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        if attention_mask is not None:
            scores = scores.masked_fill(attention_mask[:, None, None, :] == 0, -1e4)
        out = F.softmax(scores, dim=-1) @ v
        return self.c_proj(out.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), attention_mask=attention_mask)
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """GPT-2 shaped: token + position embeddings, pre-norm blocks, lm_head tied to wte."""

    def __init__(self, vocab: int = 256, ctx: int = 32, dim: int = 64, heads: int = 4,
                 layers: int = 3) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(ctx, dim)
        self.h = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, input_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(pos)[None]
        for block in self.h:
            x = block(x, attention_mask=attention_mask)
        return {"logits": self.lm_head(self.ln_f(x)), "hidden": x}


def tiny_gpt_inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (2, 12), generator=g)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :4] = 0  # left padding on the second sequence
    return {"input_ids": ids, "attention_mask": mask}


class ReadsChildWeight(nn.Module):
    """Uses ``inner``'s weight through ``F.linear`` without calling ``inner`` (like swin's
    ShiftedWindowAttention and MultiheadAttention's ``out_proj``)."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.inner = nn.Linear(dim, dim)
        self.gate = nn.Parameter(torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.inner.weight, self.inner.bias) * self.gate


def small_vit() -> nn.Module:
    """torchvision's VisionTransformer at 32x32: class_token, pos_embedding and
    MultiheadAttention (in_proj_weight on a non-leaf, out_proj read without a call)."""
    from torchvision.models import VisionTransformer

    return VisionTransformer(image_size=32, patch_size=8, num_layers=3, num_heads=4,
                             hidden_dim=64, mlp_dim=128, num_classes=10)


class HeadFirst(nn.Module):
    """Its head is registered before its body: registration order is not execution order."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(64, 10)
        self.body = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class WithEmptyLayer(nn.Module):
    """A layer whose tensors hold no elements (a head of width 0): 0 bytes, yet torch still
    checks their device and dtype when it runs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(16, 16)
        self.z = nn.Linear(16, 1)
        self.z.weight = nn.Parameter(torch.empty(0, 16))  # nn.Linear(16, 0) warns
        self.z.bias = nn.Parameter(torch.empty(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return h + self.z(h).sum()


def dynamically_quantized() -> nn.Module:
    """Two linear layers quantized by ``torch.ao``: their int8 weights are packed in
    ``torch.ScriptObject``s, not parameters. Skips where this torch no longer has it."""
    quantize = getattr(torch.ao.quantization, "quantize_dynamic", None)
    if quantize is None:
        pytest.skip("this torch has no torch.ao.quantization.quantize_dynamic")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).eval()
    with warnings.catch_warnings():
        # torch.ao's own deprecation, and quantized tensors' (torch warns once per process)
        warnings.simplefilter("ignore")
        return quantize(model, {nn.Linear}, dtype=torch.qint8).eval()


# -- the zoo: small real models every engine must run unchanged ------------------------------


def _torchvision(name: str, size: int) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    torch.manual_seed(0)
    kwargs = {"init_weights": False} if name == "inception_v3" else {}
    model = torchvision.models.get_model(name, weights=None, **kwargs).eval()
    return model, (torch.randn(1, 3, size, size),), {}


def _vit_small() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    torch.manual_seed(0)
    return small_vit().eval(), (torch.randn(1, 3, 32, 32),), {}


def _gpt() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    torch.manual_seed(0)
    return TinyGPT().eval(), (), tiny_gpt_inputs()


ZOO: dict[str, Callable[[], tuple[nn.Module, tuple[Any, ...], dict[str, Any]]]] = {
    "resnet50": functools.partial(_torchvision, "resnet50", 64),
    "densenet121": functools.partial(_torchvision, "densenet121", 64),
    "inception_v3": functools.partial(_torchvision, "inception_v3", 75),
    "mobilenet_v3_large": functools.partial(_torchvision, "mobilenet_v3_large", 64),
    "vit_b_16": functools.partial(_torchvision, "vit_b_16", 224),
    "vit_small": _vit_small,
    "swin_t": functools.partial(_torchvision, "swin_t", 64),
    "tiny_gpt": _gpt,
}


# Zero-argument factories and example inputs, as `adaptmem plan MODULE:FACTORY --example
# MODULE:FUNCTION` takes them (the tests directory is importable while tests run).
def vit_small_example() -> torch.Tensor:
    return torch.randn(1, 3, 32, 32)


def tiny_gpt_example() -> dict[str, torch.Tensor]:
    return tiny_gpt_inputs()


def hf_gpt2() -> nn.Module:
    """A two-layer Hugging Face GPT-2 from a config (random weights, nothing downloaded)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100,
                                      n_positions=32, bos_token_id=0, eos_token_id=1,
                                      pad_token_id=0)).eval()


def hf_gpt2_example() -> dict[str, torch.Tensor]:
    return {"input_ids": torch.arange(12).reshape(2, 6) % 100}


class OddOffsets(nn.Module):
    """Large tensors (>= 1 MiB) at file offsets that are multiples of neither the page nor
    each other's item size, one spanning two 16 MiB reading pieces, the last ending the file
    unaligned; small ones between them (``LARGE`` names the large ones)."""

    LARGE = ("b", "d", "e")

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.empty(3, dtype=torch.int8), requires_grad=False)
        self.b = nn.Parameter(torch.empty(2**20 + 7, dtype=torch.float16), requires_grad=False)
        self.c = nn.Parameter(torch.empty(5), requires_grad=False)
        self.d = nn.Parameter(torch.empty(3 * 2**20 + 3, dtype=torch.float64),
                              requires_grad=False)
        self.e = nn.Parameter(torch.empty(300_001), requires_grad=False)


class _Gated(nn.Module):
    """Reads a value on the host in its forward (``.item()``): it cannot run on meta."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.abs().sum().item() > 1e9:
            x = x / 2
        return self.b(self.a(x))


def gated() -> nn.Module:
    return _Gated().eval()


def gated_example() -> torch.Tensor:
    return torch.randn(2, 16)


class CallsItself(nn.Module):
    """A forward that calls its own model again (a recursive, two-pass model)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.randn(8))
        self.interrupt = False

    def forward(self, x: torch.Tensor, depth: int = 1) -> torch.Tensor:
        x = self.a(x)
        if self.interrupt:
            raise KeyboardInterrupt
        if depth > 0:
            x = x + self(x, depth - 1)
        return x * self.scale


class WaitsOffMain(nn.Module):
    """Identity. Called from a thread other than the main one, it sets ``started`` and waits
    for ``go_on`` (10 s at most): a forward held in flight while the test acts."""

    def __init__(self) -> None:
        super().__init__()
        self.started, self.go_on = threading.Event(), threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if threading.current_thread() is not threading.main_thread():
            self.started.set()
            self.go_on.wait(10)
        return x


class _WaitsInItsOwnCode(nn.Module):
    """Waits in a ``WaitsOffMain`` called from its own forward between two layers (not as a
    submodule: the model's own frame is the innermost one), then reads a child's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
        self.gate = WaitsOffMain()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.gate.forward(self.a(x))  # no module call: no hooks of its own
        return self.b(y) + self.a.weight.sum()


def held_in_own_code() -> tuple[nn.Module, WaitsOffMain]:
    """A model whose forward waits in its own code off the main thread (``WaitsOffMain``)."""
    torch.manual_seed(0)
    model = _WaitsInItsOwnCode().eval()
    return model, model.gate


def held_in_flight() -> tuple[nn.Module, WaitsOffMain]:
    """A small model whose forward waits in a ``WaitsOffMain`` off the main thread."""
    torch.manual_seed(0)
    gate = WaitsOffMain()
    return nn.Sequential(nn.Linear(16, 16), gate, nn.Linear(16, 16)).eval(), gate
