"""`accelerate launch --use_deepspeed --zero_stage 2 --num_processes 2 eagle_train/train.py` on CPU
(and ZeRO-3, and plain DDP): the run finishes, both ranks hold identical parameters, and the saved
head is the trained one."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from conftest import ROOT, make_tiny_llama
from helpers import write_corpus
from test_train import synthetic

from eagle_train.heads import load_head


@pytest.mark.parametrize("engine,stage", [("deepspeed", 2), ("deepspeed", 3), ("ddp", 0)])
def test_two_cpu_processes(tmp_path, engine, stage):
    target_dir = tmp_path / "target"
    make_tiny_llama(vocab_size=128, layers=4).save_pretrained(target_dir)
    write_corpus(synthetic(n=32), tmp_path / "data")
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(f"""output_dir: {tmp_path}
target:
  model: {target_dir}
data:
  source: unused
head:
  draft_vocab_size: 64
train:
  mode: online
  engine: {engine}
  zero_stage: {stage or 2}
  max_steps: 6
  warmup_steps: 2
  micro_batch_size: 2
  grad_accum: 2
  ttt_steps: 2
  eval_every: 6
  eval_batches: 1
  save_every: 3
""")
    accelerate = Path(sys.executable).with_name("accelerate")
    with socket.socket() as sock:  # a free port: a busy one (another launch on this box) can hang gloo
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # launch from a clean environment: earlier in-process tests (accelerate/DeepSpeed state) leave
    # rank and launcher variables behind, which the launched ranks must not inherit
    leaked = ("ACCELERATE_", "DEEPSPEED", "DS_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
              "MASTER_", "CROSS_", "LOCAL_SIZE", "GROUP_", "ROLE_", "TORCHELASTIC", "OMPI_", "PMI_", "CCL_")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(leaked)}
    # PYTHONFAULTHANDLER: a rank that aborts (SIGABRT) prints its Python stack, so a failure says where
    env = dict(clean, OMP_NUM_THREADS="1", TORCH_EXTENSIONS_DIR=str(ROOT / ".cache" / "torch_extensions"),
               MASTER_PORT=str(port), PYTHONFAULTHANDLER="1")
    launcher = ["--use_deepspeed", "--zero_stage", str(stage)] if engine == "deepspeed" else ["--multi_gpu"]
    cmd = [str(accelerate), "launch", *launcher, "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--main_process_port", env["MASTER_PORT"],
           str(ROOT / "eagle_train" / "train.py"), str(recipe)]
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        # a stuck rank: SIGUSR1 makes train.py print every thread's stack, so the failure says where
        ranks = [c for c in psutil.Process(proc.pid).children(recursive=True) if str(recipe) in " ".join(c.cmdline())]
        for rank in ranks:
            os.kill(rank.pid, signal.SIGUSR1)
        time.sleep(3)
        for rank in ranks:
            rank.kill()
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"2-rank launch timed out after 300 s; rank stacks:\n{err[-12000:]}")
    assert proc.returncode == 0, err[-8000:]
    ckpt = tmp_path / "train/checkpoint"
    if engine == "deepspeed":
        assert (ckpt / "pytorch_model").is_dir()  # a DeepSpeed (ZeRO) checkpoint, not DDP
    else:
        assert (ckpt / "model.safetensors").is_file()
    assert (ckpt / "train_state.json").is_file()
    state = json.loads((tmp_path / "train/final/train_state.json").read_text())
    digests = state["rank_param_sha256"]
    assert state["step"] == 6 and len(digests) == 2 and digests[0] == digests[1]
    # the saved head holds the trained weights (gathered whole under ZeRO-3), and it loads
    assert state["saved_param_sha256"] == digests[0]
    head = load_head(tmp_path / "train/final")
    assert all(torch.isfinite(p).all() and p.abs().sum() > 0 for p in head.parameters())


def test_a_launched_rank_leaves_without_the_interpreter_teardown():
    """exit_stage: a rank of a multi-process launch (WORLD_SIZE > 1) ends through os._exit, so native thread pools
    are not torn down (atexit handlers stand for that teardown here); its buffered output still comes out, its exit
    code stands. A single process exits normally."""
    code = ("import atexit; from eagle_train.cli import exit_stage; atexit.register(print, 'teardown'); "
            "print('written'); exit_stage(3)")
    for world, teardown in (("2", False), ("1", True)):
        run = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, WORLD_SIZE=world),
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 3, run.stderr
        assert run.stdout.startswith("written")  # a pipe is block-buffered: flushed before os._exit
        assert ("teardown" in run.stdout) == teardown
