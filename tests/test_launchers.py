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

`launch/ed_reference.py` (the reference model) is tested in-process: its `--dry_run` plan for the main flag
combinations, its done checks (the finished steps' files made in a tmp folder), a real run with the
subprocesses recorded, and its flag errors (one line, exit 2).
"""

from __future__ import annotations

import importlib.util
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
# The reference model's launcher (launch/ed_reference.py): its plan, its done checks, its flags
# ----------------------------------------------------------------------------------------------------------

ED_REFERENCE = REPO / "launch" / "ed_reference.py"
ALL_STEPS = ["import", "reply targets", "text-only shards", "stage coe", "dev evaluation of the coe stage",
             "stage ccl_units", "stage ccl", "stage sac", "export", "emotion head", "the avatar",
             "dev evaluation of the export", "the head's combination", "dev evaluation of the first 16",
             "model card"]


@pytest.fixture(scope="module")
def ed_reference():
    """launch/ed_reference.py as a module (launch/ is not a package)."""
    spec = importlib.util.spec_from_file_location("ed_reference", ED_REFERENCE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["ed_reference"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules["ed_reference"]


def plan_of(ed_reference, args: list[str], capsys, monkeypatch
            ) -> tuple[list[tuple[str, str, str]], list[str]]:
    """`--dry_run`'s plan as (status, step name, command) and its other lines (needs, notes)."""
    monkeypatch.chdir(REPO)  # main() moves to the repository root; this puts the test's cwd back after
    assert ed_reference.main([*args, "--dry_run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    steps, other = [], []
    for i, line in enumerate(lines):
        head = line.split(". [", 1)
        if head[0].strip().isdigit():
            status, name = head[1].split("] ", 1)
            steps.append((status, name, lines[i + 1].strip()))
        elif not line.startswith("      "):
            other.append(line)
    return steps, other


def names(steps: list[tuple[str, str, str]]) -> list[str]:
    """Each step's name as the ALL_STEPS prefix it starts with (or whole)."""
    return [next((p for p in ALL_STEPS if name.startswith(p)), name) for _, name, _ in steps]


def command(steps: list[tuple[str, str, str]], prefix: str) -> list[str]:
    return shlex.split(next(c for _, name, c in steps if name.startswith(prefix)))


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def make_export(folder: Path, max_len: int = 256, card: bool = True) -> Path:
    """A stand-in PEFT export (the launcher reads its files, never its tensors, in a dry run)."""
    folder.mkdir(parents=True)
    for name, data in (("adapter_model.safetensors", b"lora"), ("heads.safetensors", b"cs+sd"),
                       ("emotion_head.safetensors", b"old head")):
        (folder / name).write_bytes(data)
    if card:
        (folder / "card.json").write_text("{}")
    (folder / "empatheia_config.json").write_text(json.dumps({"config": {"data": {"max_len": max_len}}}))
    return folder


def test_ed_reference_help_and_usage_errors() -> None:
    """The launcher runs as a script: --help lists its flags; a bad flag is one line on stderr and exit 2."""
    p = subprocess.run([sys.executable, str(ED_REFERENCE), "--help"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0 and "--coe_from" in p.stdout and "Exit status" in p.stdout
    p = subprocess.run([sys.executable, str(ED_REFERENCE), "/tmp/run", "--bogus"], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2 and not p.stdout
    assert p.stderr.splitlines() == [
        "error: unrecognized argument '--bogus' (only --config.FIELD=VALUE passes, to the coe stage) "
        "(python launch/ed_reference.py --help)"]


@pytest.mark.parametrize(("args", "error"), [
    (["--holdout", "val:0.2"], "--holdout val:0.2: expected dev:FRACTION"),
    (["--holdout", "dev:1.5"], "--holdout dev:1.5: expected dev:FRACTION"),
    (["--ed_stages", "ccl_unit ccl"], "--ed_stages: unknown stage 'ccl_unit'"),
    (["--sample_stages", "sac,overal"], "--sample_stages: unknown stage 'overal'"),
    (["--text_eval"], "--text_eval measures again what --coe_from's card would carry: give --coe_from"),
    (["--coe_from", "{tmp}/nothing"], "--coe_from: {tmp}/nothing: neither an export"),
    (["--coe_from", "{tmp}/reference", "--config.optim.lr=1"],
     "--config.optim.lr=1: --config overrides reach the coe stage, which --coe_from replaces"),
    (["--head_from", "{tmp}/head.safetensors"], "--head_from {tmp}/head.safetensors: no such file"),
    (["--export_dtype", "int8"], "--export_dtype int8: expected one of"),
    (["--ed_ckpt_every", "0"], "--ed_ckpt_every 0: must be at least 1"),
    (["--speech_examples", "-1"], "--speech_examples -1: must be at least 0"),
    (["--eval_flags", "--x 'open"], "--eval_flags: No closing quotation"),
    (["--config.optim.lr", "1"], "unrecognized argument '--config.optim.lr'"),
    (["--coe_fro", "x"], "unrecognized argument '--coe_fro'"),  # no abbreviations
    ([], "the following arguments are required: rundir"),
])
def test_ed_reference_flag_errors_are_one_line_and_exit_2(ed_reference, tmp_path, capsys, monkeypatch, args,
                                                          error) -> None:
    make_export(tmp_path / "reference")
    args = [a.format(tmp=tmp_path) for a in args]
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as exit_:
        ed_reference.main(([str(tmp_path / "run")] if args else []) + [*args, "--dry_run"])
    out = capsys.readouterr()
    assert exit_.value.code == 2 and not out.out
    assert len(out.err.splitlines()) == 1 and out.err.startswith(f"error: {error.format(tmp=tmp_path)}")


def test_ed_reference_plans_a_fresh_run(ed_reference, tmp_path, capsys, monkeypatch) -> None:
    """Every step to do, in order; each stage starts from the one before; the --config overrides reach the
    coe stage alone; the card records the command; the missing `make demo` files are named."""
    run = tmp_path / "run"
    steps, other = plan_of(ed_reference, [str(run), "--config.schedule.coe.steps=7"], capsys, monkeypatch)
    assert names(steps) == ALL_STEPS
    assert {status for status, _, _ in steps} == {"to do"}
    coe, units, ccl, sac = (command(steps, f"stage {s} ") for s in ("coe", "ccl_units", "ccl", "sac"))
    assert coe[-1] == "--config.schedule.coe.steps=7" and flag(coe, "--config") == "configs/smollm2_ed.py"
    assert all("--config.schedule.coe.steps=7" not in c for c in (units, ccl, sac))
    assert [flag(c, "--workdir") for c in (coe, units, ccl, sac)] == [
        str(run / d) for d in ("coe", "ed_ccl_units", "ed_ccl", "sac")]
    assert [c[c.index("--workdir") - 1] for c in (units, ccl, sac)] == [
        f"--config.init_from={run / d}" for d in ("coe", "ed_ccl_units", "ed_ccl")]
    assert f"--config.data.shards={run / 'ed' / 'shards'}" in ccl
    assert "--config.data.shards=work/shards" in sac
    assert flag(command(steps, "export"), "--ckpt") == str(run / "sac")
    assert "--max_len" not in command(steps, "export")
    card = command(steps, "model card")
    assert [card[i + 1] for i, w in enumerate(card) if w == "--workdir"] == [
        str(run / d) for d in ("coe", "ed_ccl_units", "ed_ccl", "sac")]
    assert flag(card, "--command") == f"python launch/ed_reference.py {run} --config.schedule.coe.steps=7"
    assert "--text_from" not in card and "--chained_from" not in card and "--avatar_from" not in card
    assert "needs work/smollm2/COMPLETE (missing: run `make demo`, or give --work)" in other


def test_ed_reference_plans_a_chain_from_a_finished_coe_stage(ed_reference, tmp_path, capsys,
                                                               monkeypatch) -> None:
    """--coe_from: no coe stage or its evaluation; the ED stages start from it; the export keeps its prompt
    budget; the card lists its adapter's history (--chained_from) and the command names it."""
    run, coe_from = tmp_path / "run", make_export(tmp_path / "reference", max_len=123)
    args = [str(run), "--coe_from", str(coe_from), "--sample_stages", "0", "--work", str(tmp_path / "w")]
    steps, other = plan_of(ed_reference, args, capsys, monkeypatch)
    left_out = ("stage coe", "dev evaluation of the coe stage", "stage sac")
    assert names(steps) == [n for n in ALL_STEPS if n not in left_out]
    assert f"--config.init_from={coe_from}" in command(steps, "stage ccl_units ")
    export = command(steps, "export")
    assert flag(export, "--ckpt") == str(run / "ed_ccl") and flag(export, "--max_len") == "123"
    card = command(steps, "model card")
    assert flag(card, "--chained_from") == str(coe_from)
    assert [card[i + 1] for i, w in enumerate(card) if w == "--workdir"] == [str(run / "ed_ccl_units"),
                                                                           str(run / "ed_ccl")]
    assert flag(card, "--command") == (f"python launch/ed_reference.py {run} --coe_from={coe_from} "
                                       "--sample_stages=0")
    assert f"note: the coe stage is {coe_from} (--coe_from)" in other


def test_ed_reference_skips_the_text_steps_when_the_adapter_is_coe_froms(ed_reference, tmp_path, capsys,
                                                                        monkeypatch) -> None:
    """When the export's adapter holds --coe_from's values (decided once it is exported), the head, the text
    evaluations and the head's weights are skipped and the card carries --coe_from's text figures."""
    run, coe_from = tmp_path / "run", make_export(tmp_path / "reference")
    monkeypatch.setattr(ed_reference.Reference, "carries_text", lambda self: True)
    steps, _ = plan_of(ed_reference, [str(run), "--coe_from", str(coe_from), "--sample_stages", "0"], capsys,
                       monkeypatch)
    status = dict(zip(names(steps), (s for s, _, _ in steps), strict=True))
    skipped = ["emotion head", "dev evaluation of the export", "the head's combination",
               "dev evaluation of the first 16"]
    assert [n for n in status if status[n].startswith("skip")] == skipped
    assert status["emotion head"] == f"skip: the text figures are carried from {coe_from}"
    card = command(steps, "model card")
    assert flag(card, "--text_from") == str(coe_from) and "--metrics" not in card
    assert "--chained_from" not in card and flag(card, "--avatar_metrics") == str(run / "report_avatar.json")


def test_ed_reference_plans_a_remeasure(ed_reference, tmp_path, capsys, monkeypatch) -> None:
    """`--coe_from EXPORT --ed_stages 0 --sample_stages 0 --text_eval`: no stage trains, nothing is exported,
    no reply targets are made; the export is a copy of EXPORT's files, every reading of it names the
    converted backbone, the avatar is carried (--avatar_from), and the sample's shards are not needed."""
    run, coe_from, work = tmp_path / "run", make_export(tmp_path / "reference"), tmp_path / "w"
    args = [str(run), "--coe_from", str(coe_from), "--ed_stages", "0", "--sample_stages", "0", "--text_eval",
            "--work", str(work)]
    steps, other = plan_of(ed_reference, args, capsys, monkeypatch)
    assert names(steps) == ["import", "text-only shards", f"--coe_from's export, to be measured again -> "
                            f"{run / 'export'}", "emotion head", "dev evaluation of the export",
                            "the head's combination", "dev evaluation of the first 16", "model card"]
    assert "--targets" not in command(steps, "text-only shards")
    assert steps[2][2] == f"shutil.copytree({coe_from}, {run / 'export'}) less emotion_head.safetensors"
    readers = [command(steps, p) for p in ("emotion head", "dev evaluation of the export",
                                           "dev evaluation of the first 16")]
    assert all(flag(c, "--backbone") == str(work / "smollm2") for c in readers)
    assert "--reply_candidates" in readers[1]
    card = command(steps, "model card")
    assert flag(card, "--avatar_from") == str(coe_from) and "--workdir" not in card
    assert "--avatar_metrics" not in card and "--chained_from" not in card
    assert flag(card, "--command") == (f"python launch/ed_reference.py {run} --coe_from={coe_from} "
                                       "--ed_stages=0 --sample_stages=0 --text_eval")
    assert [line for line in other if line.startswith("needs")] == [
        f"needs {work / 'smollm2' / 'COMPLETE'} (missing: run `make demo`, or give --work)"]


def test_ed_reference_plans_without_sample_stages(ed_reference, tmp_path, capsys, monkeypatch) -> None:
    """--sample_stages 0 exports the last ED stage; with --ed_stages 0 too the coe stage is all there is
    (nothing to export); --nocoe_eval drops its evaluation."""
    run = tmp_path / "run"
    steps, _ = plan_of(ed_reference, [str(run), "--sample_stages", "0"], capsys, monkeypatch)
    assert names(steps) == [n for n in ALL_STEPS if n != "stage sac"]
    assert flag(command(steps, "export"), "--ckpt") == str(run / "ed_ccl")
    steps, other = plan_of(ed_reference, [str(run), "--sample_stages", "0", "--ed_stages", "0"], capsys,
                           monkeypatch)
    assert names(steps) == ALL_STEPS[:5] and "note: no stage after the coe stage: nothing to export" in other
    steps, _ = plan_of(ed_reference, [str(run), "--sample_stages=0", "--ed_stages=0", "--nocoe_eval"], capsys,
                       monkeypatch)
    assert names(steps) == ALL_STEPS[:4]


def finished_stage(workdir: Path, stage: str, steps: int, saved: int) -> None:
    """A training workdir as the trainer leaves it: its config.json and a complete checkpoint step."""
    (workdir / "checkpoints" / str(saved)).mkdir(parents=True)
    (workdir / "config.json").write_text(json.dumps({"schedule": {stage: {"steps": steps}}}))


def current_targets(folder: Path, mouth: str | None = None) -> None:
    from empatheia_jax.generators.kokoro_voices import MAP_VERSION
    from empatheia_jax.generators.visemes import MOUTH_VERSION

    folder.mkdir(parents=True)
    meta = {kind: {"voice_map_version": MAP_VERSION, "mouth_version": mouth or MOUTH_VERSION}
            for kind in ("speech_content", "speech_style", "video_content", "video_style")}
    (folder / "meta.json").write_text(json.dumps(meta))


def test_ed_reference_done_checks_skip_finished_steps(ed_reference, tmp_path, capsys, monkeypatch) -> None:
    """A step whose output exists is done: the data, a stage saved at its last step, an evaluation newer
    than the checkpoints it read. A stage saved short of its last step, targets made with another mouth
    rule, and an evaluation older than its checkpoints are to do."""
    run = tmp_path / "run"
    (run / "ed" / "raw").mkdir(parents=True)
    (run / "ed" / "raw" / "dev.json").write_text("[]")
    current_targets(run / "ed" / "targets")
    (run / "ed" / "shards").mkdir()
    (run / "ed" / "shards" / "manifest.json").write_text("{}")
    finished_stage(run / "coe", "coe", 10, 10)
    (run / "report").mkdir()
    (run / "report" / "metrics.json").write_text("{}")
    os.utime(run / "coe" / "checkpoints", (1, 1))  # the report is newer than the checkpoints it read
    finished_stage(run / "ed_ccl_units", "ccl_units", 10, 5)  # preempted at step 5
    steps, _ = plan_of(ed_reference, [str(run)], capsys, monkeypatch)
    status = dict(zip(names(steps), (s for s, _, _ in steps), strict=True))
    assert [n for n in ALL_STEPS if status[n] == "done"] == ALL_STEPS[:5]
    os.utime(run / "coe" / "checkpoints")  # trained on since the report: evaluated again
    (run / "ed" / "targets" / "meta.json").unlink()
    current_targets(run / "ed" / "targets2", mouth="0")
    (run / "ed" / "targets2" / "meta.json").rename(run / "ed" / "targets" / "meta.json")
    steps, _ = plan_of(ed_reference, [str(run), "--config.schedule.coe.steps=10"], capsys, monkeypatch)
    status = dict(zip(names(steps), (s for s, _, _ in steps), strict=True))
    # with --config overrides the coe stage goes to the trainer (it alone resolves them; finished, it returns)
    assert [n for n in ALL_STEPS if status[n] == "done"] == ["import", "text-only shards"]


def test_ed_reference_run_skips_what_is_done_and_stops_a_preempted_stage(ed_reference, tmp_path,
                                                                        monkeypatch) -> None:
    """A real run calls only the steps to do; a stage whose trainer returns before its last step (a
    preemption) ends the run with status 3 before the next step; run again, it goes on from there."""
    run, work = tmp_path / "run", tmp_path / "work"
    for need in (work / "smollm2" / "COMPLETE", work / "shards" / "manifest.json"):
        need.parent.mkdir(parents=True)
        need.write_text("{}")
    (run / "ed" / "raw").mkdir(parents=True)
    (run / "ed" / "raw" / "dev.json").write_text("[]")
    current_targets(run / "ed" / "targets")
    (run / "ed" / "shards").mkdir()
    (run / "ed" / "shards" / "manifest.json").write_text("{}")
    finished_stage(run / "coe", "coe", 10, 10)
    calls: list[list[str]] = []
    monkeypatch.setattr(ed_reference.Reference, "call", lambda self, argv: calls.append(argv))
    monkeypatch.chdir(REPO)
    args = [str(run), "--work", str(work), "--nocoe_eval", "--sample_stages", "0"]
    assert ed_reference.main(args) == 3  # ccl_units trained nothing: not finished
    assert [c[3:5] for c in calls] == [["train", "--config"]]
    assert "--config.stage=ccl_units" in calls[0]
    finished_stage(run / "ed_ccl_units", "ccl_units", 10, 10)
    calls.clear()
    assert ed_reference.main(args) == 3
    assert [c for c in calls[0] if c.startswith("--config.stage=")] == ["--config.stage=ccl"]


def test_ed_reference_remeasure_runs_the_steps_to_do_once(ed_reference, tmp_path, monkeypatch) -> None:
    """The re-measure for real, with the subprocesses recorded (each leaves the file it makes): the export
    is a copy of --coe_from's files whose emotion head is fitted again; run again, every step is done; a
    head fitted again later makes the steps that read it run again."""
    run, work, coe_from = tmp_path / "run", tmp_path / "work", make_export(tmp_path / "reference")
    (work / "smollm2").mkdir(parents=True)
    (work / "smollm2" / "COMPLETE").write_text("{}")
    calls: list[list[str]] = []

    def call(self, argv: list[str]) -> None:  # a stand-in subprocess: records argv, writes its output
        calls.append(argv)
        outputs = {"--json": None, "--report": "metrics.json", "--out": "manifest.json"}
        for name, inside in outputs.items():
            if name in argv:
                out = Path(flag(argv, name))
                if inside:
                    out.mkdir(parents=True, exist_ok=True)
                    out = out / inside
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text("{}")
        if "probe" in argv:
            Path(flag(argv, "--ckpt"), "emotion_head.safetensors").write_bytes(b"new head")
        if "empatheia_jax.eval.model_card" in argv:
            Path(argv[3], "card.json").write_text("{}")

    monkeypatch.setattr(ed_reference.Reference, "call", call)
    monkeypatch.chdir(REPO)
    args = [str(run), "--coe_from", str(coe_from), "--ed_stages", "0", "--sample_stages", "0", "--text_eval",
            "--work", str(work)]
    (run / "ed" / "raw").mkdir(parents=True)
    (run / "ed" / "raw" / "dev.json").write_text("[]")
    assert ed_reference.main(args) == 0
    assert [c[2:4] for c in calls] == [
        ["data.prepare", "--raw"], ["empatheia_jax.eval.fit_emotion_head", "probe"],
        ["empatheia_jax.cli", "eval"], ["empatheia_jax.eval.fit_emotion_head", "weights"],
        ["empatheia_jax.cli", "eval"],
        ["empatheia_jax.eval.model_card", str(run / "export")]]  # no train, export or avatar evaluation
    export = run / "export"
    assert (export / "adapter_model.safetensors").read_bytes() == b"lora"
    assert (export / "emotion_head.safetensors").read_bytes() == b"new head"  # fitted again, not --coe_from's
    calls.clear()
    assert ed_reference.main(args) == 0 and calls == []
    os.utime(run / "emotion_head_weights.json", (1, 1))  # older than the head: chosen again, card rewritten
    assert ed_reference.main(args) == 0
    assert [c[3] for c in calls] == ["weights", str(export)]
