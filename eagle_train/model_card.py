"""The model card (README.md) of an exported head: what it is, how it was trained, how well it
drafts (tau per benchmark and temperature, speedup, machine) and copy-paste serving commands
filled with the best tree setting the sweep found.

Every input but the head and the recipe is optional; a missing eval report reads "not evaluated".
"""

from __future__ import annotations

import hashlib
import json

from eagle_train.decoding import SpecConfig, max_tree_nodes
from eagle_train.eval.summary import lossless_rows

# aliases the toolkit ships -> the hub model an engine should serve
HUB_IDS = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}


def serving_target(model: str) -> str:
    return HUB_IDS.get(model, model)


def _evaluated(tree: str, topk: int, depth: int, nd: int, static_tree=None) -> dict:
    """The setting as decoded: num_draft_tokens capped by the one node-cap rule of the decoder."""
    cfg = SpecConfig(tree=tree, topk=int(topk), depth=int(depth), num_draft_tokens=int(nd), static_tree=static_tree)
    return {"tree": tree, "topk": 1 if tree == "chain" else int(topk), "depth": int(depth),
            "num_draft_tokens": max_tree_nodes(cfg)}


def best_setting(cfg, report: dict | None, sweep: dict | None) -> tuple[dict, str]:
    """(tree, topk, depth, num_draft_tokens) for the serving commands, and where it came from."""
    if sweep and sweep.get("best"):
        b = sweep["best"]
        tree = b.get("tree") or ("chain" if int(b["topk"]) == 1 else "dynamic")
        return (_evaluated(tree, b["topk"], b["depth"], b["num_draft_tokens"]),
                "the best setting `eagle-train sweep` found")
    if report and report.get("settings"):
        s = report["settings"]
        if all(k in s for k in ("topk", "depth", "num_draft_tokens")):
            return (_evaluated(s.get("tree", "dynamic"), s["topk"], s["depth"], s["num_draft_tokens"],
                               s.get("static_tree")), "the eval report's setting")
    e = cfg.eval
    static = [list(x) for x in e.static_tree] if e.static_tree else None
    return (_evaluated(e.tree, e.topk, e.depth, e.num_draft_tokens, static),
            "the recipe's eval section; no sweep was run")


def chain_setting(setting: dict, report: dict | None, sweep: dict | None) -> tuple[int, str]:
    """(vLLM num_speculative_tokens, its label): vLLM drafts a chain, so the line carries the
    measured chain tau, never a tree's."""
    sweep = sweep or {}
    chains = [r for r in lossless_rows(sweep.get("results", []), sweep.get("target_dtype", "float32"))
              if int(r.get("topk", 0)) == 1]
    if chains:
        c = max(chains, key=lambda r: r["speedup"])
        return int(c["depth"]), (f"the best chain the sweep measured: τ {c['tau']:.2f}, speedup "
                                 f"{c['speedup']:.2f}x")
    rows = (report or {}).get("results") or []
    if (report or {}).get("settings", {}).get("tree") == "chain" and rows:
        return int(report["settings"]["depth"]), f"the evaluated chain: τ {rows[0]['tau']:.2f} ({rows[0]['benchmark']})"
    return setting["depth"], ("chain τ not measured; run `eagle-train sweep` with 1 in eval.sweep_topk to measure "
                              "it (the tree τ below does not apply to a chain)")


def sglang_tree_flags(setting: dict) -> str:
    """SGLang's flags for one of our tree settings. SGLang's --speculative-num-draft-tokens counts the
    verified root; our num_draft_tokens does not: +1 here and nowhere else."""
    return (f"--speculative-num-steps {setting['depth']} --speculative-eagle-topk {setting['topk']} "
            f"--speculative-num-draft-tokens {setting['num_draft_tokens'] + 1}")


def serving_commands(head_type: str, target: str, repo: str, setting: dict, target_revision=None,
                     head_revision=None, chain_depth: int | None = None) -> tuple[str, str | None]:
    """(vLLM command, SGLang command or None). vLLM drafts a chain of `chain_depth` tokens; SGLang
    serves the evaluated tree exactly (`sglang_tree_flags`). SGLang has no static trees: None for those."""
    spec = {"method": "eagle3" if head_type == "eagle3" else "eagle", "model": repo,
            "num_speculative_tokens": chain_depth or setting["depth"]}
    if head_revision:
        spec["revision"] = head_revision
    vllm = f"vllm serve {target}"
    if target_revision:
        vllm += f" --revision {target_revision}"
    vllm += f" \\\n  --speculative-config '{json.dumps(spec)}'"
    if setting.get("tree") == "static":
        return vllm, None
    sglang = f"python -m sglang.launch_server --model {target}"
    if target_revision:
        sglang += f" --revision {target_revision}"
    sglang += (f" \\\n  --speculative-algorithm {'EAGLE3' if head_type == 'eagle3' else 'EAGLE'}"
               f" \\\n  --speculative-draft-model-path {repo}")
    if head_revision:
        sglang += f" --speculative-draft-model-revision {head_revision}"
    sglang += f" \\\n  {sglang_tree_flags(setting)}"
    return vllm, sglang


def _fmt(x, nd=2):
    if x is None:
        return "-"
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def eval_section(report: dict | None, sweep: dict | None) -> list:
    lines = ["## Evaluation", ""]
    if not report or not report.get("results"):
        lines += ["Not evaluated. Run `eagle-train eval recipe.yaml` (and `eagle-train sweep recipe.yaml`), "
                  "then `eagle-train export recipe.yaml` again to fill this table.", ""]
    else:
        s = report.get("settings") or {}
        copy = any(r.get("copy_branch") for r in report["results"])
        lines += [f"Measured on: {report.get('machine', 'unknown machine')}"
                  + (f", {report['date']}" if report.get("date") else "") + ".",
                  f"Draft tree: {s.get('tree', '?')}, topk {s.get('topk', '?')}, depth {s.get('depth', '?')}, "
                  f"{s.get('num_draft_tokens', '?')} draft tokens, {s.get('max_new_tokens', '?')} new tokens. "
                  "τ = mean tokens accepted per target forward pass, bonus token included: the head alone, as "
                  "vLLM and SGLang draft."
                  + (f" The last column: eagle-train's own decoder with its copy branch (up to {s.get('lookup_tokens')}"
                     " tokens prompt lookup proposes join each tree, `eval.lookup_tokens`), which the engines do not "
                     "run." if copy else ""), "",
                  "| benchmark | temperature | τ | speedup | tok/s spec | tok/s vanilla | prompts | "
                  "prompt lookup τ / speedup |" + (" with the copy branch τ / speedup |" if copy else ""),
                  "|---|---|---|---|---|---|---|---|" + ("---|" if copy else "")]
        for r in report["results"]:
            pls = list((r.get("baselines") or {}).values())
            pl = max(pls, key=lambda b: b["speedup"]) if pls else None
            lines.append(f"| {r.get('benchmark')} | {_fmt(r.get('temperature'), 1)} | {_fmt(r.get('tau'))} | "
                         f"{_fmt(r.get('speedup'))}{'x' if r.get('speedup') is not None else ''} | "
                         f"{_fmt(r.get('tokens_per_s_spec'), 1)} | {_fmt(r.get('tokens_per_s_vanilla'), 1)} | "
                         f"{_fmt(r.get('n_prompts'))} | "
                         + (f"{pl['tau']:.2f} / {pl['speedup']:.2f}x |" if pl else "- |")
                         + (f" {r['copy_branch']['tau']:.2f} / {r['copy_branch']['speedup']:.2f}x |"
                            if r.get("copy_branch") else " - |" if copy else ""))
        lines.append("")
    if sweep and sweep.get("results"):
        b = sweep.get("best") or {}
        lines += [f"Tree-setting sweep: {len(sweep['results'])} settings; best topk {b.get('topk')}, depth "
                  f"{b.get('depth')}, {b.get('num_draft_tokens')} draft tokens: τ {_fmt(b.get('tau'))}, "
                  f"speedup {_fmt(b.get('speedup'))}x."]
        m = sweep.get("most_tau")
        if m and m != b:  # on a GPU a wide tree costs about one target pass: the most-tau tree is the start there
            lines[-1] += (f" Most τ: topk {m['topk']}, depth {m['depth']}, {m['num_draft_tokens']} draft tokens, "
                          f"τ {_fmt(m['tau'])} (speedup {_fmt(m['speedup'])}x on the machine above; on a GPU, where "
                          "a target pass over that many tokens costs about one token, start from this tree: SGLang "
                          f"`{sglang_tree_flags(m)}`).")
        lines += [""]
    return lines


def deploy_section(eval_dir) -> list:
    """The `eagle-train deploy` table (speedup against batch size) and its advice, when
    <eval dir>/deploy.json exists; nothing otherwise."""
    from pathlib import Path

    path = Path(eval_dir) / "deploy.json"
    try:
        dep = json.loads(path.read_text()) if path.is_file() else None
    except json.JSONDecodeError:
        dep = None
    if not dep or not dep.get("rows"):
        return []
    lines = ["## When to deploy", "", f"Advice: **{dep['advice']}** ({dep.get('device', '?')}; "
             f"load average {(dep.get('load_average') or {}).get('start')}; {dep.get('date', '')}): the head's gain "
             "shrinks as the batch grows and the target stops being memory-bound.", "",
             "| batch | speedup | tok/s generate | tok/s EAGLE | latency generate / EAGLE (s) |", "|---|---|---|---|---|"]
    for r in dep["rows"]:
        g, h = r["generate"], r["head"]
        lines.append(f"| {r['batch_size']} | {r['speedup']:.2f}x | {g['tokens_per_s']:.1f} | {h['tokens_per_s']:.1f} | "
                     f"{g['latency_mean_s']:.2f} / {h['latency_mean_s']:.2f} |")
    return lines + [""]


def tasks_note(data: dict) -> str:
    """How a corpus was turned into tasks, where the recipe said so (data.prompt_template, data.po_direction)."""
    return ((f", tasks `{data['prompt_template']}`" if data.get("prompt_template") else "")
            + (f", catalogs translated {data['po_direction'].replace('_', ' ')} (`data.po_direction`)"
               if data.get("po_direction") else ""))


def training_lines(head_type: str, train_state: dict) -> list:
    """The data and settings the head was trained with, as its training run recorded them."""
    data, run = train_state.get("data") or {}, train_state.get("train") or {}
    dump = data.get("dump") or {}  # the dump it read (recorded since the fifth polish)
    lines = []
    if data.get("source"):
        what = ((f"at most {data['max_conversations']} " if data.get("max_conversations") else "")
                + ("conversations" if data.get("max_conversations") or data.get("skip_conversations") else "")
                + (f" after the first {data['skip_conversations']}" if data.get("skip_conversations") else ""))
        what += ", " if what else ""
        lines.append(f"- data: `{data['source']}` ({what}max {data.get('max_length')} tokens each"
                     + tasks_note(data) + f", {data.get('loss_positions', 'assistant')} tokens in the loss"
                     + (f", {dump['num_tokens']} tokens" if dump.get("num_tokens") is not None else "") + ")")
    for i, extra in enumerate(data.get("extra_dumps") or []):
        d = extra.get("data") or {}
        lines.append(f"- and another dump (`train.extra_dumps[{i}]`): `{d.get('source')}`"
                     + (f", conversations after the first {d['skip_conversations']}" if d.get("skip_conversations") else "")
                     + tasks_note(d) + f", max {d.get('max_length')} tokens each, {extra.get('num_tokens')} tokens")
    if run:
        lines.append(f"- head: {head_type}, {run.get('mode')} training"
                     + (f" ({run['storage']} features)" if run.get("storage") else "")
                     + f", lr {run.get('learning_rate')}, {run.get('max_steps')} planned steps"
                     + (f", TTT unroll {run.get('ttt_steps')}" if head_type == "eagle3" else "")
                     + (f", fine-tuned from the head `{run['init']}`" if run.get("init") not in (None, "none") else ""))
    if not data and not run:
        lines.append("- training settings: not recorded with the head (train writes them into <train.output>/final)")
    return lines


def render(head, cfg, recipe_yaml: str, config: dict, train_state: dict | None = None,
           data_stats: dict | None = None, report: dict | None = None, sweep: dict | None = None) -> str:
    head_type = head.head_type
    c = head.config
    target = serving_target(cfg.target.model)
    repo = cfg.hub.repo_id or "<your-name>/<this-repo>"
    setting, setting_src = best_setting(cfg, report, sweep)
    chain_depth, chain_label = chain_setting(setting, report, sweep)
    vllm, sglang = serving_commands(head_type, target, repo, setting, cfg.target.revision, cfg.hub.revision, chain_depth)
    n_params = sum(p.numel() for n, p in head.named_parameters()
                   if not n.startswith("embed_tokens") and not (head_type == "eagle1" and n.startswith("lm_head")))
    name = "EAGLE-3" if head_type == "eagle3" else "EAGLE-1/2"

    front = ["---", "library_name: eagle-train", "tags:", "- speculative-decoding",
             f"- {'eagle3' if head_type == 'eagle3' else 'eagle'}", "- draft-model"]
    if "/" in target and not target.startswith((".", "/", "~")):
        front += [f"base_model: {target}"]
    front += ["---", ""]

    lines = front + [
        f"# {name} draft head for {target}", "",
        f"A speculative-decoding draft head ({name}) for `{target}`"
        + (f" (revision `{cfg.target.revision}`)" if cfg.target.revision else "")
        + ", trained with eagle-train. It does not generate "
          "text on its own: serve it next to the target with vLLM or SGLang.", "",
        "## Serve it", "",
        f"Tree setting: {setting['tree']} tree, topk {setting['topk']}, depth {setting['depth']}, "
        f"{setting['num_draft_tokens']} draft tokens, from {setting_src}.", "",
        f"vLLM drafts a chain of `num_speculative_tokens` = {chain_depth} tokens; {chain_label}:", "",
        "```bash", vllm, "```", "",
    ]
    if sglang:
        lines += ["SGLang serves the setting above exactly (its `--speculative-num-draft-tokens` counts the verified "
                  "root token too):", "", "```bash", sglang, "```", ""]
    else:
        lines += ["SGLang has no static trees: the evaluated static tree cannot be served as is; run "
                  "`eagle-train sweep` for a dynamic-tree setting it serves.", ""]
    lines += eval_section(report, sweep)
    lines += deploy_section(cfg.eval.output)
    lines += ["## Head", "", "| | |", "|---|---|",
              f"| type | {name} (`{config['architectures'][0]}`) |",
              f"| target | `{cfg.target.model}`" + (f" @ `{cfg.target.revision}`" if cfg.target.revision else "") + " |",
              f"| trainable parameters | {n_params / 1e6:.1f} M |",
              f"| weights dtype | {config['torch_dtype']} |",
              f"| hidden size / layers | {c.hidden_size} / 1 draft decoder layer |"]
    if head_type == "eagle3":
        hf = list(c.aux_layers)
        lines += [f"| draft vocabulary | {c.draft_vocab_size} of {c.vocab_size} target tokens "
                  "(`d2t`: target id = draft id + d2t[draft id]; `t2d`: membership mask) |",
                  f"| target features (HF `hidden_states` indices) | {hf} |",
                  f"| vLLM `eagle_aux_hidden_state_layer_ids` (input of decoder layer id) | {[i for i in hf]} |",
                  f"| SGLang `eagle_config.eagle_aux_hidden_state_layer_ids` (output of decoder layer id) | "
                  f"{[i - 1 for i in hf]} |"]
    else:
        lines += ["| feature | the target's last hidden state (post-norm); embed_tokens and lm_head are the target's |"]
    lines += ["", "Both aux-layer keys are in `config.json`, each in the convention of the engine that reads it. "
              "`eagle-train check <folder> --target <model>` validates the layout against the target.", ""]

    # what training recorded beside the head (train.py: train_state), not the recipe at export time
    lines += ["## Training", ""] + training_lines(head_type, train_state or {})
    if data_stats:
        lines.append("- corpus stats: " + ", ".join(f"{k} {v}" for k, v in data_stats.items()
                                                      if isinstance(v, (int, float, str)))[:400])
    if train_state:
        steps = train_state.get("step", train_state.get("steps", train_state.get("global_step")))
        if steps is not None:
            lines.append(f"- trained steps: {steps}")
        metrics = train_state.get("metrics") or {k: v for k, v in train_state.items()
                                                 if isinstance(v, (int, float)) and k not in ("step", "steps")}
        if metrics:
            lines.append("- final metrics: " + ", ".join(f"{k} {_fmt(v, 4)}" for k, v in metrics.items()
                                                          if isinstance(v, (int, float))))
    else:
        lines.append("- trained steps: not recorded")
    sha = hashlib.sha256(recipe_yaml.encode()).hexdigest()
    lines += ["", "## Recipe", "", f"Resolved recipe (sha256 `{sha[:16]}`); rerun any stage with it, e.g. "
              "`eagle-train eval recipe.yaml eval.head=" + repo + "`.", "",
              "<details><summary>recipe.yaml</summary>", "", "```yaml", recipe_yaml.rstrip(), "```", "",
              "</details>", ""]
    return "\n".join(lines)
