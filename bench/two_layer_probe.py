"""Probe (not a feature): does a second draft decoder layer help the EAGLE-3 head? vLLM loads multi-layer EAGLE-3
heads (the layers after the first read the H-wide hidden only, no token embedding); SGLang loads one. This runs
`eagle-train train` with, when EAGLE_PROBE_LAYERS=2, a plain Llama decoder layer after the head's midlayer, started
as the identity (o_proj and down_proj zero) on top of the `head.init` head, and trained with the same TTT
structure (step 0 causal; step s the step-0 keys plus its own diagonal keys). Only train.py's held-out evaluations
are meaningful: the decoders and the export know one layer. bench/RESULTS.md "## A second draft layer".

    EAGLE_PROBE_LAYERS=2 python bench/two_layer_probe.py train recipes/smollm2-135m-eagle3.yaml head.init=... ...
"""

import os
import sys

import torch
from torch import nn

import eagle_train.eagle3 as eagle3
import eagle_train.head_init as head_init
import eagle_train.heads as heads
import eagle_train.train as train
import eagle_train.ttt as ttt
from eagle_train.layers import MLP, Attention, RMSNorm

TWO = os.environ.get("EAGLE_PROBE_LAYERS") == "2"


class Layer2(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        with torch.no_grad():  # the identity: the 2-layer head starts as the 1-layer one
            self.self_attn.o_proj.weight.zero_()
            self.mlp.down_proj.weight.zero_()


_init = eagle3.Eagle3Head.__init__


def head_init_with_layer2(self, cfg):
    _init(self, cfg)
    if TWO:
        self.layer2 = Layer2(cfg)


def start_head(init, head):
    """head.init's 1-layer head, loaded without the probe's layer."""
    global TWO
    if init in head_init.INIT_NAMES:
        return None
    two, TWO = TWO, False
    try:
        return heads.load_head(init)
    finally:
        TWO = two


def copy_start(head, start, lm_head_w=None):
    theirs = start.state_dict()
    for name, p in head.named_parameters():
        if p.requires_grad and name in theirs:
            p.copy_(theirs[name].float())


def ttt_unroll(head, ids, aux, steps, recompute=False, project=True):
    """ttt.ttt_unroll with the optional second layer."""
    mid, two = head.midlayer, getattr(head, "layer2", None)
    hidden = head.fc(aux[:, :-1].to(head.fc.weight.dtype))
    B, n = hidden.shape[:2]
    pos = torch.arange(n, device=ids.device).expand(B, n)
    kv1, kv2 = {}, {}
    for s in range(steps):
        tok = ttt.shift(ids, 1 + s)[:, :n]
        cos, sin = head.rotary(hidden, pos + s)
        x = mid.attn_input(head.embed_tokens(tok).to(hidden.dtype), hidden)
        o = ttt.ttt_step_attention(*mid.self_attn.qkv(x, cos, sin), kv1, recompute)
        out = mid.finish(hidden, mid.self_attn.o_proj(o.transpose(1, 2).reshape(B, n, -1)))
        if two is not None:
            o = ttt.ttt_step_attention(*two.self_attn.qkv(two.input_layernorm(out), cos, sin), kv2, recompute)
            h = out + two.self_attn.o_proj(o.transpose(1, 2).reshape(B, n, -1))
            out = h + two.mlp(two.post_attention_layernorm(h))
        yield out, head.lm_head(head.norm(out)) if project else head.norm(out)
        hidden = out


eagle3.Eagle3Head.__init__ = head_init_with_layer2
train.start_head, head_init.copy_start, ttt.ttt_unroll = start_head, copy_start, ttt_unroll

if __name__ == "__main__":
    from eagle_train.cli import main

    sys.exit(main())
