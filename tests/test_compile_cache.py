"""The commands' persistent compilation cache (`empatheia_jax.compile_cache`): on by default in the cache
folder, the environment's choice kept, and a second process reading what the first compiled."""

from __future__ import annotations

import os
import subprocess
import sys

from helpers import REPO

# The folder, the cache's size limit and compile-time floor in force, the seconds to get f's executable and
# how many programs were read from the cache.
PROGRAM = """
import sys, time
from empatheia_jax import compile_cache
print(compile_cache.use_persistent_cache())
import jax, jax.numpy as jnp
print(jax.config.jax_compilation_cache_max_size, jax.config.jax_persistent_cache_min_compile_time_secs)
hits = []
HIT = "/jax/compilation_cache/cache_hits"
jax.monitoring.register_event_listener(lambda name, **_: hits.append(name == HIT))

def f(x):
    for _ in range(40):
        x = jnp.sin(x @ x.T) + x
    return x

t = time.perf_counter()
jax.jit(f).lower(jnp.ones((64, 64))).compile()
print(time.perf_counter() - t, sum(hits))
"""


def _run(env: dict[str, str]) -> tuple[str, int, float, float, int]:
    p = subprocess.run([sys.executable, "-c", PROGRAM], env=env, cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    folder, max_size, min_secs, seconds, hits = p.stdout.split()
    return folder, int(max_size), float(min_secs), float(seconds), int(hits)


def _env(tmp_path, cache: str = "cache", **extra: str) -> dict[str, str]:
    chosen = ("JAX_COMPILATION_CACHE", "JAX_PERSISTENT")  # the suite's own cache settings, left out
    env = {k: v for k, v in os.environ.items() if not k.startswith(chosen)}
    env.update(EMPATHEIA_CACHE=str(tmp_path / cache), PYTHONPATH=str(REPO), **extra)
    return env


def test_the_defaults_and_a_second_process_reading_what_the_first_compiled(tmp_path):
    from empatheia_jax import compile_cache

    # the defaults, in a cache of their own: on a busy machine a program may compile past the 0.1-s floor
    defaults = tmp_path / "defaults" / "jax_compilation_cache"
    got = _run(_env(tmp_path, "defaults"))[:3]
    assert got == (str(defaults), compile_cache.MAX_BYTES, compile_cache.MIN_COMPILE_SECS)
    folder = tmp_path / "cache" / "jax_compilation_cache"
    # f compiles in less than the floor: the environment lowers it (and wins over the default)
    every = _env(tmp_path, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    first = _run(every)
    assert first[2] == 0.0 and first[4] == 0
    entries = sorted(p.name for p in folder.iterdir())
    assert any(name.startswith("jit_f-") for name in entries), entries
    second = _run(every)
    assert second[0] == first[0] and second[4] >= 1  # f (and the ops it needs) read, not compiled
    assert sorted(p.name for p in folder.iterdir()) == entries


def test_the_environment_chooses_another_folder_or_none(tmp_path):
    other = tmp_path / "mine"
    assert _run(_env(tmp_path, JAX_COMPILATION_CACHE_DIR=str(other)))[0] == str(other)
    assert not (tmp_path / "cache" / "jax_compilation_cache").exists()
    assert _run(_env(tmp_path, JAX_COMPILATION_CACHE_DIR=""))[0] == "None"


def test_every_command_turns_it_on(tmp_path):
    """The console entry point turns it on for its own process (here a command that fails at its first
    flag: the folder is made before any work)."""
    p = subprocess.run([sys.executable, "-m", "empatheia_jax.cli", "eval", "--ckpt", str(tmp_path / "none")],
                       env=_env(tmp_path), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    assert (tmp_path / "cache" / "jax_compilation_cache").is_dir()


def test_an_unwritable_cache_folder_only_turns_it_off(tmp_path):
    (tmp_path / "cache").write_text("a file where the cache folder would be")
    folder, *_, seconds, hits = _run(_env(tmp_path))
    assert folder == "None" and hits == 0 and seconds > 0
