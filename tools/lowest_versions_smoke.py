"""The smoke test tools/lowest_versions.sh runs against the lowest declared dependency versions.

Run it with the interpreter of a venv that has triaccel-jax installed (not editable), from outside
the checkout, with the path of README.md as the argument::

    python tools/lowest_versions_smoke.py README.md

It checks, in order: ``import triaccel_jax``; the README's example (the ```python block under
"## Example" or "## Example: ...", read from README.md at run time so it stays in step with the
README); an optax-only step (the transform, ``plan_precision``, a Controller with a pure-JAX
loss); and ``memory_report`` of a step with a jitted helper (it walks the step's jaxpr with
``jax.extend.core``).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import pathlib
import re
import sys
import tempfile

_DISTRIBUTIONS = ("jax", "jaxlib", "optax", "numpy", "ml_dtypes", "scipy", "psutil", "flax")


def readme_example(readme: pathlib.Path) -> str:
    """The first ```python block after the "## Example" heading of ``readme`` (the heading may
    go on with a title after a colon: "## Example: the per-layer signals")."""
    text = readme.read_text(encoding="utf-8")
    heading = re.search(r"^## Example(?::[^\n]*)?[ \t]*$", text, flags=re.MULTILINE)
    if heading is None:
        raise SystemExit(f"{readme}: no '## Example' heading")
    section = text[heading.end() :]
    following = re.search(r"^## ", section, flags=re.MULTILINE)
    if following is not None:
        section = section[: following.start()]
    block = re.search(
        r"^```python[ \t]*\n(.*?)^```[ \t]*$", section, flags=re.MULTILINE | re.DOTALL
    )
    if block is None:
        raise SystemExit(f"{readme}: no ```python block under '## Example'")
    return block.group(1)


def versions() -> str:
    found = []
    for name in _DISTRIBUTIONS:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found.append(f"{name} {importlib.metadata.version(name)}")
    return ", ".join(found)


def optax_only_step() -> None:
    """As in .ci/run's packaging step: the transform, the planner, the controller."""
    import jax.numpy as jnp
    import numpy as np
    import optax

    import triaccel_jax

    params = {"w": jnp.ones((64, 8))}
    tx = triaccel_jax.triaccel(1e-2)
    state = tx.init(params)
    updates, state = tx.update({"w": jnp.full((64, 8), 0.1)}, state, params)
    params = optax.apply_updates(params, updates)
    triaccel_jax.plan_precision(triaccel_jax.signals(state), params)
    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    loss = lambda p, batch, *, policy, rng: jnp.mean((batch[0] @ p["w"] - batch[1]) ** 2)
    controller = triaccel_jax.Controller(
        loss,
        {"w": jnp.zeros(4)},
        triaccel_jax.triaccel(0.05),
        (x, x.sum(1)),
        min_batch=16,
        max_batch=32,
        probe=triaccel_jax.BudgetMemoryProbe(2**30),
        check_every=5,
    )
    history = controller.run(5)
    assert np.isfinite(history[-1].loss), history[-1]
    # psutil: the default budget is a fraction of the available RAM.
    assert triaccel_jax.BudgetMemoryProbe().read(batch_size=1).limit_bytes > 0


def memory_report_step() -> None:
    """memory_report reads the residuals of a step with a jitted helper from its jaxpr."""
    import jax
    import jax.numpy as jnp

    import triaccel_jax

    params = {"w": jnp.ones((64, 64)), "b": jnp.zeros(64)}
    opt_state = triaccel_jax.triaccel(1e-2).init(params)
    policy = triaccel_jax.PrecisionPolicy.from_patterns(params, {"w": "bf16"})
    layer = jax.jit(lambda w, x: jnp.tanh(x @ w))

    def step(p, batch):
        return jnp.mean(layer(p["w"].astype(jnp.bfloat16), batch.astype(jnp.bfloat16)) + p["b"])

    report = triaccel_jax.memory_report(params, opt_state, policy, step, jnp.ones((8, 64)))
    assert report.total > 0, report


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        raise SystemExit(f"usage: {argv[0]} path/to/README.md")
    readme = pathlib.Path(argv[1]).resolve()
    example = readme_example(readme)
    print(f"[smoke] {versions()}", flush=True)

    import triaccel_jax

    here = pathlib.Path(triaccel_jax.__file__).resolve()
    assert "site-packages" in here.parts, f"triaccel_jax imported from {here}, not the install"
    print(f"[smoke] ok: import triaccel_jax {triaccel_jax.__version__}", flush=True)

    with tempfile.TemporaryDirectory() as scratch:
        cwd = os.getcwd()
        os.chdir(scratch)  # whatever the example writes lands in a throwaway folder
        try:
            exec(compile(example, f"{readme.name} (## Example)", "exec"), {"__name__": "__main__"})
        finally:
            os.chdir(cwd)
    print("[smoke] ok: the README example", flush=True)

    optax_only_step()
    print("[smoke] ok: an optax-only step (triaccel, plan_precision, Controller)", flush=True)

    memory_report_step()
    print("[smoke] ok: memory_report of a step with a jitted helper", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
