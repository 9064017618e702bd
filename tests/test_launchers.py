"""The launch scripts: they parse, and the multi-host ones say exactly what each process will run.

`launch/tpu_pod.sh` and `launch/slurm_gpu.sbatch` cannot run here (no gcloud, no SLURM), so:

- `DRY_RUN=1` prints, per process, the host, process id and count, the coordinator, the environment and
  the exact command; checked line for line for a 2-host example, including an override with a space (the
  command lines are shell words: `shlex.split` gives back each process's argv);
- the REAL paths run against stand-ins put first on PATH (`gcloud`; `srun`, which starts the script once
  per task like SLURM does, and `env`, which the tasks exec) that only record their arguments: what
  would have been started equals what the dry run printed, so the two cannot drift apart.

Also every launcher exists, starts with a shebang, sets `-euo pipefail` and passes `bash -n` (moved here
from tests/test_multihost.py).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAUNCH = sorted((REPO / "launch").glob("*.sh")) + sorted((REPO / "launch").glob("*.sbatch"))
TPU = REPO / "launch" / "tpu_pod.sh"
SLURM = REPO / "launch" / "slurm_gpu.sbatch"
ARGS = ["configs/tiny.py", "/shared/runs/a", "--config.data.shards=/shared/my shards",
        "--config.train.batch_size=16"]
# What the scripts read; cleared so a developer's or CI runner's own settings cannot leak in.
INPUTS = {"DRY_RUN", "TPU", "ZONE", "PROJECT", "REPO", "WORKERS", "COORDINATOR_PORT", "EMPATHEIA_LAUNCH_TASK",
          "XLA_PYTHON_CLIENT_MEM_FRACTION"}


def run(script: Path, args: list[str], env: dict[str, str], path: Path | None = None
        ) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in INPUTS and not k.startswith("SLURM_")}
    if path is not None:
        base["PATH"] = f"{path}{os.pathsep}{base['PATH']}"
    return subprocess.run(["bash", str(script), *args], env={**base, **env}, cwd=REPO, capture_output=True,
                          text=True, timeout=60)


def recorder(bin_dir: Path, name: str, body: str = "") -> Path:
    """A stand-in command `name` on PATH that writes its argv (and SLURM_PROCID) to LOG/<name>-<pid>.json."""
    bin_dir.mkdir(exist_ok=True)
    log = bin_dir / "log"
    log.mkdir(exist_ok=True)
    exe = bin_dir / name
    exe.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import json, os, sys
        with open(os.path.join({str(log)!r}, "{name}-%d.json" % os.getpid()), "w") as f:
            json.dump({{"argv": sys.argv[1:], "procid": os.environ.get("SLURM_PROCID")}}, f)
        """) + textwrap.dedent(body))
    exe.chmod(0o755)
    return log


def recorded(log: Path, name: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(log.glob(f"{name}-*.json"))]


def distributed(coordinator: str, count: int, pid: int) -> str:
    return (f"--config.distributed.initialize=True --config.distributed.coordinator_address={coordinator} "
            f"--config.distributed.num_processes={count} --config.distributed.process_id={pid}")


# ----------------------------------------------------------------------------------------------------------
# Every launcher
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("script", LAUNCH, ids=[p.name for p in LAUNCH])
def test_launch_script_parses(script: Path) -> None:
    p = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    text = script.read_text()
    assert text.startswith("#!"), "launch scripts start with a shebang"
    assert "\nset -euo pipefail\n" in text


def test_every_launcher_exists() -> None:
    names = {p.name for p in LAUNCH}
    assert {"local.sh", "tpu_pod.sh", "slurm_gpu.sbatch"} <= names


# ----------------------------------------------------------------------------------------------------------
# TPU pod
# ----------------------------------------------------------------------------------------------------------

TPU_ENV = {"TPU": "my-tpu", "ZONE": "us-east5-a"}
LOCAL = "launch/local.sh configs/tiny.py /shared/runs/a"  # ARGS as shell words: the space is quoted
QUOTED = "'--config.data.shards=/shared/my shards' --config.train.batch_size=16"
TPU_COMMAND = f"cd ~/empatheia_jax && HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 {LOCAL} {QUOTED} "
TPU_SSH = ("gcloud compute tpus tpu-vm ssh my-tpu --zone us-east5-a --worker={i} --command "
           f"'cd ~/empatheia_jax && HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 {LOCAL} "
           r"'\''--config.data.shards=/shared/my shards'\'' --config.train.batch_size=16 {dist}'")


def test_tpu_dry_run_prints_each_workers_command() -> None:
    p = run(TPU, ARGS, {**TPU_ENV, "DRY_RUN": "1", "WORKERS": "10.0.0.2 10.0.0.3"})
    assert p.returncode == 0, p.stderr
    coord = "10.0.0.2:8482"
    expected = [
        f"[tpu_pod.sh] 2 processes on TPU my-tpu, coordinator {coord} (dry run)",
        "preflight: gcloud compute tpus tpu-vm ssh my-tpu --zone us-east5-a --worker=all --command true",
    ]
    for i, host in enumerate(("10.0.0.2", "10.0.0.3")):
        expected += [
            f"process {i}: host={host} process_id={i} process_count=2 coordinator={coord}",
            "  env: HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1",
            "  command: " + TPU_COMMAND + distributed(coord, 2, i),
            "  ssh: " + TPU_SSH.format(i=i, dist=distributed(coord, 2, i)),
        ]
    assert p.stdout.splitlines() == expected
    # The printed lines are shell words: the worker's shell gets back exactly these arguments.
    for i in range(2):
        command = expected[4 + 4 * i].removeprefix("  command: ")
        ssh = shlex.split(expected[5 + 4 * i].removeprefix("  ssh: "))
        assert ssh[-1] == command and ssh[-2] == "--command"
        assert shlex.split(command) == ["cd", "~/empatheia_jax", "&&", "HF_HUB_OFFLINE=1",
                                        "TRANSFORMERS_OFFLINE=1", "launch/local.sh", *ARGS,
                                        *distributed(coord, 2, i).split()]


def test_tpu_dry_run_options_and_quotes() -> None:
    """PROJECT, REPO and COORDINATOR_PORT reach the lines; an override with a single quote survives."""
    args = [*ARGS[:2], "--config.model.tokenizer=/it's here"]
    env = {**TPU_ENV, "DRY_RUN": "1", "WORKERS": "w0 w1 w2", "PROJECT": "proj", "REPO": "/opt/e",
           "COORDINATOR_PORT": "9999"}
    p = run(TPU, args, env)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    commands = [line.removeprefix("  command: ") for line in lines if line.startswith("  command: ")]
    ssh = [shlex.split(line.removeprefix("  ssh: ")) for line in lines if line.startswith("  ssh: ")]
    assert len(commands) == len(ssh) == 3
    for i in range(3):
        words = shlex.split(commands[i])
        assert words[:2] == ["cd", "/opt/e"]
        assert words[5:] == ["launch/local.sh", *args, *distributed("w0:9999", 3, i).split()]
        assert ssh[i][:9] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-tpu", "--zone", "us-east5-a",
                              "--project"]
        assert ssh[i][9:] == ["proj", f"--worker={i}", "--command", commands[i]]


def test_tpu_real_run_sends_what_the_dry_run_printed(tmp_path: Path) -> None:
    """No WORKERS: the addresses come from `gcloud ... describe`; then one --worker=all preflight and one
    ssh per worker, each with the command the dry run printed for that worker."""
    bin_dir = tmp_path / "bin"
    log = recorder(bin_dir, "gcloud", """\
        if "describe" in sys.argv:
            print("10.0.0.2")
            print("10.0.0.3")
        """)
    p = run(TPU, ARGS, TPU_ENV, path=bin_dir)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == ["[tpu_pod.sh] 2 processes on TPU my-tpu, coordinator 10.0.0.2:8482"]
    calls = [c["argv"] for c in recorded(log, "gcloud")]
    describe = [c for c in calls if "describe" in c]
    assert describe == [["compute", "tpus", "tpu-vm", "describe", "my-tpu", "--zone", "us-east5-a",
                         "--flatten=networkEndpoints[]", "--format=value(networkEndpoints.ipAddress)"]]
    dry = run(TPU, ARGS, {**TPU_ENV, "DRY_RUN": "1", "WORKERS": "10.0.0.2 10.0.0.3"}).stdout.splitlines()
    printed = [shlex.split(line.split(": ", 1)[1])[1:] for line in dry
               if line.startswith(("preflight: ", "  ssh: "))]
    assert sorted(c for c in calls if "describe" not in c) == sorted(printed) and len(printed) == 3


def test_tpu_real_run_fails_when_a_worker_fails(tmp_path: Path) -> None:
    """Every worker is waited for, and the script exits with the first failed worker's status."""
    bin_dir = tmp_path / "bin"
    log = recorder(bin_dir, "gcloud", """\
        for bad, status in (("--worker=1", 3), ("--worker=2", 4)):
            if bad in sys.argv:
                sys.exit(status)
        """)
    p = run(TPU, ARGS, {**TPU_ENV, "WORKERS": "a b c"}, path=bin_dir)
    assert p.returncode == 3
    workers = sorted(c["argv"][7] for c in recorded(log, "gcloud"))
    assert workers == ["--worker=0", "--worker=1", "--worker=2", "--worker=all"]


def test_tpu_needs_its_name_and_zone() -> None:
    p = run(TPU, ARGS, {"ZONE": "z", "DRY_RUN": "1", "WORKERS": "a b"})
    assert p.returncode == 2 and "TPU, ZONE" in p.stderr and not p.stdout


# ----------------------------------------------------------------------------------------------------------
# SLURM
# ----------------------------------------------------------------------------------------------------------

SLURM_ENVS = "HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9"
SRUN = ("srun --kill-on-bad-exit=1 --export=ALL,EMPATHEIA_LAUNCH_TASK=1 launch/slurm_gpu.sbatch "
        f"configs/tiny.py /shared/runs/a {QUOTED}")


def test_slurm_dry_run_prints_each_tasks_command() -> None:
    """Two nodes, one task each; outside SLURM, from the variables a job would have."""
    env = {"DRY_RUN": "1", "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_JOB_ID": "1234",
           "SLURM_NTASKS_PER_NODE": "1"}
    p = run(SLURM, ARGS, env)
    assert p.returncode == 0, p.stderr
    coord = f"gpu01:{1234 % 4096 + 61440}"  # jax's port for the job (SlurmCluster.get_coordinator_address)
    expected = [
        f"[slurm_gpu.sbatch] 2 processes on 2 nodes (1 a node), coordinator {coord} (dry run)",
        f"dir: {REPO}",
        f"srun: {SRUN}",
    ]
    for i, host in enumerate(("gpu01", "gpu02")):
        expected += [
            f"process {i}: host={host} gpu=0 process_id={i} process_count=2 coordinator={coord}",
            f"  env: {SLURM_ENVS}",
            f"  command: env {SLURM_ENVS} {LOCAL} {QUOTED} {distributed(coord, 2, i)}",
        ]
    assert p.stdout.splitlines() == expected
    for i in range(2):
        argv = shlex.split(expected[5 + 3 * i].removeprefix("  command: "))
        assert argv == ["env", *SLURM_ENVS.split(), "launch/local.sh", *ARGS,
                        *distributed(coord, 2, i).split()]


def test_slurm_dry_run_places_tasks_by_node() -> None:
    """Two tasks a node (block distribution, SLURM's default): process 2 is gpu02's GPU 0; the task count per
    node defaults to the script's own #SBATCH --ntasks-per-node; host lists expand without scontrol."""
    env = {"DRY_RUN": "1", "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_NTASKS_PER_NODE": "2",
           "COORDINATOR_PORT": "7777", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}
    lines = run(SLURM, ARGS, env).stdout.splitlines()
    heads = [line for line in lines if line.startswith("process ")]
    assert heads == [f"process {i}: host=gpu0{1 + i // 2} gpu={i % 2} process_id={i} process_count=4 "
                     f"coordinator=gpu01:7777" for i in range(4)]
    assert "  env: HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.5" in lines
    p = run(SLURM, ARGS, {"DRY_RUN": "1", "SLURM_JOB_NODELIST": "n[08-10,3],login1"})
    heads = [line.split()[2] for line in p.stdout.splitlines() if line.startswith("process ")]
    assert heads == [f"host={h}" for h in ("n08", "n09", "n10", "n3", "login1") for _ in range(8)]
    assert p.stdout.startswith("[slurm_gpu.sbatch] 40 processes on 5 nodes (8 a node), coordinator n08:61440")


def test_slurm_real_run_execs_what_the_dry_run_printed(tmp_path: Path) -> None:
    """Inside a (simulated) job: the batch step runs srun once; srun's stand-in starts the script once per
    task with SLURM_PROCID/SLURM_LOCALID and the exported variables, as SLURM does; each task execs `env ...`,
    whose stand-in records the arguments: process p's equal the dry run's command for p."""
    bin_dir = tmp_path / "bin"
    log = recorder(bin_dir, "srun", """\
        import subprocess
        args = sys.argv[1:]
        env = dict(os.environ)
        while args[0].startswith("--"):
            opt = args.pop(0)
            if opt.startswith("--export=ALL,"):
                env.update(kv.split("=", 1) for kv in opt.removeprefix("--export=ALL,").split(","))
        per_node = int(env["SLURM_NTASKS_PER_NODE"])
        status = 0
        for rank in range(int(env["SLURM_NTASKS"])):
            task = {**env, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank % per_node)}
            status |= subprocess.run(args, env=task).returncode
        sys.exit(status)
        """)
    recorder(bin_dir, "env")
    job = {"SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_JOB_ID": "99", "SLURM_NTASKS": "2",
           "SLURM_NTASKS_PER_NODE": "1", "SLURM_SUBMIT_DIR": str(REPO)}
    p = run(SLURM, ARGS, job, path=bin_dir)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == ["[slurm_gpu.sbatch] 2 processes on 2 nodes (1 a node), coordinator "
                                     f"gpu01:{99 + 61440}"]
    dry = run(SLURM, ARGS, {**job, "DRY_RUN": "1"}).stdout.splitlines()
    assert [c["argv"] for c in recorded(log, "srun")] == [shlex.split(dry[2].removeprefix("srun: "))[1:]]
    commands = [shlex.split(line[len("  command: "):]) for line in dry if line.startswith("  command: ")]
    tasks = sorted(recorded(log, "env"), key=lambda c: int(c["procid"]))
    assert [c["procid"] for c in tasks] == ["0", "1"]
    assert [c["argv"] for c in tasks] == [argv[1:] for argv in commands]


def test_slurm_refuses_to_run_outside_a_job() -> None:
    p = run(SLURM, ARGS, {})
    assert p.returncode == 2 and "not inside a SLURM job" in p.stderr and "DRY_RUN=1" in p.stderr
    p = run(SLURM, ARGS, {"DRY_RUN": "1"})
    assert p.returncode == 2 and "SLURM_JOB_NODELIST" in p.stderr


# ----------------------------------------------------------------------------------------------------------
# The reference model's launcher
# ----------------------------------------------------------------------------------------------------------

ED_REFERENCE = REPO / "launch" / "ed_reference.sh"


def fake_python(bin_dir: Path, log: Path) -> Path:
    """A stand-in PY for launch/ed_reference.sh: its inline snippets (`PY -`) run in this interpreter; every
    `PY -m MODULE ...` is recorded (argv) and leaves the files the launcher checks for (the head, the
    report), so the steps run without a model."""
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / "python"
    exe.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import json, os, sys
        from pathlib import Path
        argv = sys.argv[1:]
        if argv[0] == "-":
            os.execv({sys.executable!r}, [{sys.executable!r}, *argv])
        with open({str(log)!r}, "a") as f:
            f.write(json.dumps(argv) + "\\n")
        def flag(name):
            return argv[argv.index(name) + 1] if name in argv else None
        if argv[1:3] == ["empatheia_jax.eval.fit_emotion_head", "probe"]:
            Path(flag("--ckpt"), "emotion_head.safetensors").write_bytes(b"head")
        if flag("--report"):
            Path(flag("--report")).mkdir(parents=True, exist_ok=True)
            Path(flag("--report"), "metrics.json").write_text("{{}}")
        """))
    exe.chmod(0o755)
    return exe


def test_ed_reference_measures_a_finished_export_again_without_training(tmp_path: Path) -> None:
    """`COE_FROM=EXPORT ED_STAGES=0 SAMPLE_STAGES=0 TEXT_EVAL=1`: no stage trains, nothing is exported and no
    reply targets are made (the text evaluation reads none);
    the export measured is COE_FROM's files (a head it carries is fitted again), every reading of it names
    the converted backbone, the avatar is not evaluated but carried (`model_card --avatar_from`, no
    --chained_from), and the card's command says how it was made. Run again, the finished steps are
    skipped. Without TEXT_EVAL=1 the same command does nothing."""
    work, run_dir, coe_from = tmp_path / "work", tmp_path / "run", tmp_path / "reference"
    (work / "smollm2").mkdir(parents=True)  # the backbone; no sample shards: a re-measure reads none
    (work / "smollm2" / "COMPLETE").write_text("{}")
    coe_from.mkdir()
    for name, data in (("adapter_model.safetensors", b"lora"), ("heads.safetensors", b"cs+sd"),
                       ("emotion_head.safetensors", b"old head"), ("card.json", b"{}")):
        (coe_from / name).write_bytes(data)
    (coe_from / "empatheia_config.json").write_text(json.dumps({"config": {"data": {"max_len": 256}}}))
    log = tmp_path / "calls.jsonl"
    env = {"PY": str(fake_python(tmp_path / "bin", log)), "WORK": str(work), "COE_FROM": str(coe_from),
           "ED_STAGES": "0", "SAMPLE_STAGES": "0", "TEXT_EVAL": "1"}

    def steps(start: int = 0) -> list[list[str]]:  # the recorded model steps (not the data import)
        lines = log.read_text().splitlines()[start:] if log.exists() else []
        return [c for c in map(json.loads, lines) if not c[1].startswith(("data.", "converters."))]

    p = run(ED_REFERENCE, [str(run_dir)], env)
    assert p.returncode == 0, p.stderr
    data = [c for c in map(json.loads, log.read_text().splitlines())
            if c[1].startswith(("data.", "converters."))]
    assert [c[1] for c in data] == ["data.import_ed", "data.prepare"] and "--targets" not in data[1]
    calls = steps()
    assert [c[1:3] for c in calls] == [
        ["empatheia_jax.eval.fit_emotion_head", "probe"], ["empatheia_jax.cli", "eval"],
        ["empatheia_jax.eval.fit_emotion_head", "weights"], ["empatheia_jax.cli", "eval"],
        ["empatheia_jax.eval.model_card", str(run_dir / "export")]]  # no train, export or avatar eval
    export = run_dir / "export"
    assert (export / "adapter_model.safetensors").read_bytes() == b"lora"
    assert (export / "emotion_head.safetensors").read_bytes() == b"head"  # fitted again, not COE_FROM's
    readers = [c for c in calls if "--ckpt" in c]
    assert len(readers) == 3 and all(c[c.index("--backbone") + 1] == f"{work}/smollm2" for c in readers)
    assert "--reply_candidates" in calls[1] and "--max_examples" in calls[3]
    card = calls[-1]
    assert card[card.index("--avatar_from") + 1] == str(coe_from)
    assert "--avatar_metrics" not in card and "--chained_from" not in card and "--text_from" not in card
    assert card[card.index("--command") + 1] == (f"COE_FROM={coe_from} ED_STAGES=\"0\" SAMPLE_STAGES=0 "
                                                 f"TEXT_EVAL=1 bash launch/ed_reference.sh {run_dir}")

    n = len(log.read_text().splitlines())
    assert run(ED_REFERENCE, [str(run_dir)], env).returncode == 0  # again: the head and the dev eval are done
    assert [c[1:3] for c in steps(n)] == [
        ["empatheia_jax.eval.fit_emotion_head", "weights"], ["empatheia_jax.cli", "eval"],
        ["empatheia_jax.eval.model_card", str(export)]]

    n = len(log.read_text().splitlines())
    p = run(ED_REFERENCE, [str(run_dir)], {**env, "TEXT_EVAL": "0"})
    assert p.returncode == 2 and "shards/manifest.json is missing" in p.stderr  # not a re-measure: needed
    (work / "shards").mkdir()
    (work / "shards" / "manifest.json").write_text("{}")
    assert run(ED_REFERENCE, [str(run_dir)], {**env, "TEXT_EVAL": "0"}).returncode == 0
    assert steps(n) == []
