"""XLA's compiled programs kept between commands: jax's persistent compilation cache, on by default.

Every `empatheia` command compiles its programs again in a new process: the model's initialisers, the
train and eval steps, the decode loop. jax can keep them on disk, keyed by the program, the XLA flags and
the versions, but does so only when a folder is named. Loading the committed reference model compiles
~150 of them (15.2 s to build it cold, 7.4 s with the cache), and a whole `empatheia eval` of it ~190
(docs/benchmarks.md "The persistent compilation cache").
"""

from __future__ import annotations

import os
from pathlib import Path

from empatheia_jax.assets import cache_root

# jax locks the cache's files and evicts the least recently used entries only with a maximum size.
MAX_BYTES = 4 * 2**30
# Programs that compile in less are not worth a file: jax's default (1 s) keeps few of a command's programs.
MIN_COMPILE_SECS = 0.1


def default_folder() -> Path:
    return cache_root() / "jax_compilation_cache"


def use_persistent_cache() -> Path | None:
    """Turns the cache on in `default_folder()` unless the environment chose: JAX_COMPILATION_CACHE_DIR
    names another folder, or is empty for none. JAX_COMPILATION_CACHE_MAX_SIZE and
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS, when set, win over the defaults here. Returns the folder
    (None: no cache, also when the default folder cannot be made).
    """
    import jax

    chosen = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if chosen is not None:
        return Path(chosen) if chosen else None
    folder = default_folder()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:  # an unwritable cache folder costs the command its speed-up, not its run
        return None
    jax.config.update("jax_compilation_cache_dir", str(folder))
    if "JAX_COMPILATION_CACHE_MAX_SIZE" not in os.environ:
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECS)
    return folder
