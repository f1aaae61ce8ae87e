"""Where a draft head's weights start, for eagle_train/train.py (`head.init`), and the trained head
it hands back: frozen copies of the target's embeddings (and EAGLE-1's lm_head), then none, lm_head,
last_layer or a head folder to fine-tune; at the end a fresh fp32 head with the trained weights."""

from __future__ import annotations

import torch

from eagle_train.draft_vocab import draft_ids_of
from eagle_train.features import decoder_of
from eagle_train.heads import build_head, load_head
from eagle_train.recipe import RecipeError


INIT_NAMES = ("none", "lm_head", "last_layer")


def widened(name: str, theirs: torch.Size, ours: torch.Size) -> bool:
    """A start head narrower than the recipe's: an MLP (`head.intermediate_size`: gate/up rows and down
    columns it lacks) or, EAGLE-3, a draft vocabulary (`head.draft_vocab_size`: lm_head rows) that
    `copy_start` grows; every other tensor must match exactly."""
    if name == "lm_head.weight" or name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
        return theirs[1] == ours[1] and theirs[0] < ours[0]
    return name.endswith("mlp.down_proj.weight") and theirs[0] == ours[0] and theirs[1] < ours[1]


def start_head(init, head):
    """The head of folder `init` (a training output or an export) when `head.init` names one; its
    trained tensors must have this recipe's shapes, but for a wider MLP (`widened`)."""
    if init in INIT_NAMES:
        return None
    start = load_head(init)
    theirs = start.state_dict()
    bad = [f"{k} {tuple(theirs[k].shape) if k in theirs else 'missing'} vs {tuple(p.shape)}"
           for k, p in head.named_parameters() if p.requires_grad and (k not in theirs or (
               theirs[k].shape != p.shape and not widened(k, theirs[k].shape, p.shape)))]
    if start.head_type != head.head_type or bad:
        raise RecipeError(f"head.init={init!r}: that {start.head_type} head does not fit this recipe's "
                          f"{head.head_type} head: {'; '.join(bad[:3]) or 'head type'}")
    return start


def init_from_target(head, target, feature_scale):
    """`head.init=last_layer`: EAGLE-3's norm and lm_head from the target's final norm and lm_head
    rows, the draft layer from the target's last decoder layer where shapes allow (q/k/v: the
    target's weights on the feature half, zeros on the token half), and fc passing the high aux
    feature through; so at step 0 the head reproduces the target's prediction of token t+1."""
    H = head.config.hidden_size
    with torch.no_grad():
        if head.head_type == "eagle3":
            head.norm.weight.copy_(decoder_of(target).norm.weight.float())
            head.lm_head.weight.copy_(target.get_output_embeddings().weight.float()[draft_ids_of(head.d2t)])
        src = {k: v.float() for k, v in decoder_of(target).layers[-1].state_dict().items()}
        own = head.midlayer if head.head_type == "eagle3" else head.layers[0]
        for name, p in own.named_parameters():
            w = src.get("input_layernorm.weight" if name == "hidden_norm.weight" else name)
            if w is None:
                continue
            if w.shape == p.shape:
                p.copy_(w)
            elif p.dim() == 2 and p.shape == (w.shape[0], 2 * H) and w.shape[1] == H:  # eagle3 q/k/v
                p.zero_()
                p[:, H:] = w
        if head.head_type == "eagle3" and head.config.target_hidden_size == H:
            head.fc.weight.zero_()
            scale = feature_scale[2 * H:] if feature_scale is not None else torch.ones(H)
            head.fc.weight[:, 2 * H:] = torch.diag(scale)



def init_weights(head, init, embed, lm_head_w, norm_w, start=None, target=None, feature_scale=None,
                 freeze_lm_head=False):
    """Set `head`'s weights before training: the target's embeddings (and EAGLE-1's lm_head) as
    frozen copies, then per `head.init` (the draft vocabulary must be set already). `target`: a
    callable returning the loaded target (only `last_layer` needs it); `start`: the head of a
    `head.init` folder (`start_head`). `freeze_lm_head` (EAGLE-3): lm_head stays the target's rows
    (or the start head's) and takes no gradient."""
    with torch.no_grad():
        head.embed_tokens.weight.copy_(embed.float())
        if head.head_type == "eagle1":
            head.lm_head.weight.copy_(lm_head_w.float())
        if head.head_type == "eagle3" and freeze_lm_head and start is None and init != "last_layer":
            init = "lm_head"  # the frozen rows are the target's
        if init == "lm_head" and head.head_type == "eagle3":
            head.lm_head.weight.copy_(lm_head_w.float()[draft_ids_of(head.d2t)])
            head.norm.weight.copy_(norm_w.float())
        elif init == "last_layer":
            init_from_target(head, target(), feature_scale)
        elif start is not None:
            copy_start(head, start, lm_head_w)
            if feature_scale is not None:  # a saved fc has the scale folded in (trained_head); unfold it
                head.fc.weight.mul_(feature_scale)
    if head.head_type == "eagle3" and freeze_lm_head:
        head.lm_head.weight.requires_grad_(False)


def copy_start(head, start, lm_head_w=None):
    """`head` takes `start`'s trained tensors. A wider MLP keeps the start's units and adds new ones whose
    down_proj columns are zero (their gate/up rows keep the fresh initialization): the head computes exactly
    what `start` did, and training grows the new units from there (down first, then gate/up). A draft
    vocabulary other than the start's (its d2t set already: larger, or re-ranked by head.draft_vocab_swap) keeps
    the lm_head row of each token the two share; a new token's row is the target's lm_head row mapped by the
    least-squares fit of the start's rows on theirs."""
    theirs = start.state_dict()
    for name, p in head.named_parameters():
        if not p.requires_grad:
            continue
        w = theirs[name].float()
        if name == "lm_head.weight" and not torch.equal(draft_ids_of(head.d2t), draft_ids_of(start.d2t)):
            ours_ids, old_ids = draft_ids_of(head.d2t), draft_ids_of(start.d2t)
            at = torch.searchsorted(old_ids, ours_ids).clamp(max=len(old_ids) - 1)  # draft ids ascend with target ids
            shared = old_ids[at] == ours_ids
            tgt = lm_head_w.float()
            fit = torch.linalg.lstsq(tgt[old_ids], w).solution  # (H, H): target row -> head row
            p[shared] = w[at[shared]]
            p[~shared] = tgt[ours_ids[~shared]] @ fit
        elif w.shape == p.shape:
            p.copy_(w)
        elif name.endswith("down_proj.weight"):
            p.zero_()
            p[:, :w.shape[1]] = w
        else:
            p[:w.shape[0]] = w


def trained_head(cfg, tconf, head, state, feature_scale):
    """A fresh fp32 head holding the trained weights of `state` (the DraftLoss state dict), with the
    feature scale folded into fc. Built anew, not copied: under ZeRO-3 `head` holds a partition."""
    out = build_head(cfg.head, tconf).float()
    if out.head_type == "eagle3":
        out.set_draft_vocab(head.d2t.cpu(), head.t2d.cpu())
    missing, unexpected = out.load_state_dict(
        {k[len("head."):]: v.float().cpu() for k, v in state.items() if k.startswith("head.")}, strict=False)
    assert not unexpected and not [k for k in missing if k in dict(out.named_parameters())], missing
    if feature_scale is not None:
        out.fc.weight.data /= feature_scale
    return out
