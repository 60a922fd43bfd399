"""The planner compiles the real step on abstract shapes: its figures are those
of the step a real run compiles, and its advice is what it tried."""

import functools
import types

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import redeqx
from jax.sharding import PartitionSpec as P
from redeqx._trees import human_bytes
from tiny_transformer import TinyLM, collate_tokens, lm_loss, token_examples


def make(key):  # small enough that each compile takes about a second
    return TinyLM(vocab=128, dim=32, n_heads=4, hidden=128, n_layers=1, key=key)


def big_params(key):  # parameters outweigh activations, as in the models worth planning
    return TinyLM(vocab=512, dim=128, n_heads=4, hidden=512, n_layers=1, key=key)


BATCH = {"tokens": jax.ShapeDtypeStruct((16, 33), jnp.int32)}


@pytest.fixture
def compile_each_setting_once(monkeypatch):
    """A test that plans one configuration several times (alone, then again in a plan that explores,
    under another ``device_memory``) compiles it once: the step's figures depend only on the model,
    loss, optimizer, batch, mesh and settings, so the plan compiled first is reused with this call's
    ``device_memory`` (which decides only ``fits``). What the planner tries, in which order, and
    what it concludes is still its own doing; each distinct setting is still compiled."""
    import dataclasses

    from redeqx.planner import _plan

    real, done = _plan._one_plan, {}

    def once(abstract, loss_fn, optimizer, batch, mesh, key, settings, device_memory):
        ident = (id(loss_fn), id(optimizer), id(batch), tuple(mesh.shape.items()),
                 tuple(d.id for d in mesh.devices.flat), str(jax.tree.structure(abstract)),
                 tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(abstract)),
                 repr(sorted((k, v) for k, v in settings.items() if k != "facts")))
        if ident not in done:
            done[ident] = real(abstract, loss_fn, optimizer, batch, mesh, key, settings, device_memory)
        return dataclasses.replace(done[ident], device_memory=device_memory)

    monkeypatch.setattr(_plan, "_one_plan", once)


def test_plan_matches_the_real_step_and_its_buffers():
    mesh = redeqx.make_mesh(2)
    optimizer = optax.adamw(1e-3)
    p = redeqx.plan(make, lm_loss, optimizer, BATCH, mesh, key=jax.random.key(0), device_memory="1GB")
    assert p.fits and p.mesh == {"data": 4, "model": 2} and p.global_batch == 16
    assert "all-reduce" in p.collectives and p.flops > 0
    # the same step on real arrays: the same compiled program, the same figures
    model = make(jax.random.key(0))
    specs = redeqx.sharding_rules(model, mesh, loss_fn=lm_loss, batch=BATCH)  # the plan's own specs
    state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(0))
    batch = next(iter(redeqx.batches(token_examples(16, seq_len=32, vocab=128), collate_tokens, 4, mesh)))
    step = redeqx.make_train_step(lm_loss, optimizer, mesh, specs)
    stats = step.lower(state, batch).compile().memory_analysis()
    real_peak = stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes + stats.temp_size_in_bytes
    assert abs(p.peak - real_peak) <= 0.15 * real_peak, (p.peak, real_peak)
    # parameters and optimizer state: what the live buffers on one device hold
    device = mesh.devices.flat[0]

    def on_device(tree):
        return sum(s.data.nbytes for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))
                   for s in x.addressable_shards if s.device == device)

    assert p.parameters == on_device(state.model)
    assert abs(p.optimizer - on_device(state.opt_state)) <= 16  # Adam's step count
    assert "fits" in str(p) and "all-reduce" in str(p) and "FLOPs" in str(p)


@pytest.mark.slow
def test_plan_explores_what_would_make_it_fit(compile_each_setting_once):
    mesh = redeqx.make_mesh(1)
    batch = {"tokens": jax.ShapeDtypeStruct((8, 9), jnp.int32)}
    alone = redeqx.plan(big_params, lm_loss, optax.adamw(1e-3), batch, mesh)
    p = redeqx.plan(big_params, lm_loss, optax.adamw(1e-3), batch, mesh, device_memory=int(alone.peak * 0.75))
    assert p.fits is False and p.margin < 0 and p.peak == alone.peak
    by_label = dict(p.tried)
    assert {"fsdp=True", "remat (redeqx.remat(loss_fn))", "compute_dtype=jnp.bfloat16", "bfloat16 optimizer state",
            "n_model_shards=2"} <= set(by_label)
    # each option was compiled and measured
    assert by_label["fsdp=True"].parameters < p.parameters / 4
    assert by_label["bfloat16 optimizer state"].optimizer < 0.6 * p.optimizer
    assert by_label["n_model_shards=2"].mesh == {"data": 4, "model": 2}
    assert any(other.fits for other in by_label.values())
    text = str(p)
    assert "does NOT fit" in text and "would fit with:" in text


@pytest.mark.slow
def test_make_mesh_auto_picks_the_smallest_n_model_shards_that_fits(compile_each_setting_once):
    batch = {"tokens": jax.ShapeDtypeStruct((8, 9), jnp.int32)}
    planner = functools.partial(redeqx.plan, big_params, lm_loss, optax.adamw(1e-3), batch, explore=False)
    peaks = {k: planner(redeqx.make_mesh(k), device_memory=1e12).peak for k in (1, 2)}
    assert peaks[2] < peaks[1]
    mesh = redeqx.make_mesh("auto", planner=functools.partial(planner, device_memory=(peaks[1] + peaks[2]) // 2))
    assert dict(mesh.shape) == {"data": 4, "model": 2}
    with pytest.raises(ValueError, match="no n_model_shards fits on these 2 devices"):
        redeqx.make_mesh("auto", devices=jax.devices()[:2], planner=functools.partial(planner, device_memory=1000))
    with pytest.raises(ValueError, match="needs planner="):
        redeqx.make_mesh("auto")


def test_bf16_optimizer_state_halves_it_and_trains():
    mesh = redeqx.make_mesh(2)
    optimizer = redeqx.with_opt_state_dtype(optax.adam(1e-2), jnp.bfloat16)
    model = make(jax.random.key(0))
    specs = redeqx.sharding_rules(model, mesh)
    state = redeqx.init_state(model, optimizer, mesh, specs, key=jax.random.key(0))
    assert state.opt_state[0].mu.blocks[0].mlp.fc1.weight.dtype == jnp.bfloat16
    step = redeqx.make_train_step(lm_loss, optimizer, mesh, specs)
    losses = []
    for batch in redeqx.batches(token_examples(64, seq_len=32, vocab=128), collate_tokens, 4, mesh):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0]
    assert state.opt_state[0].nu.blocks[0].mlp.fc1.weight.dtype == jnp.bfloat16
    full = redeqx.plan(make, lm_loss, optax.adam(1e-2), BATCH, mesh)
    half = redeqx.plan(make, lm_loss, optax.adam(1e-2), BATCH, mesh, opt_state_dtype=jnp.bfloat16)
    np.testing.assert_allclose(half.optimizer, full.optimizer / 2, rtol=0.01)


LIBTPU_OOM = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries "
              "(84.27G) exceeds available HBM (30.75G).")


@pytest.mark.slow
def test_a_compiler_that_refuses_the_step_means_it_does_not_fit(monkeypatch):
    # libtpu (planning for a TPU slice from jax.experimental.topologies) refuses to compile a step
    # larger than the chip; XLA:CPU never does, so the refusal is simulated here
    refuse = lambda self, *a, **k: (_ for _ in ()).throw(jax.errors.JaxRuntimeError(LIBTPU_OOM))  # noqa: E731
    monkeypatch.setattr(jax.stages.Lowered, "compile", refuse)
    mesh = redeqx.make_mesh(1)
    p = redeqx.plan(make, lm_loss, optax.adamw(1e-3), BATCH, mesh)  # no device_memory given: still does not fit
    assert p.fits is False and p.refused.startswith("RESOURCE_EXHAUSTED")
    assert p.temporaries == int(84.27 * 2**30)
    assert p.peak == p.parameters + p.optimizer + p.batch + p.temporaries
    assert "the compiler refused the step" in str(p) and "84.27G" in str(p)
    explored = redeqx.plan(make, lm_loss, optax.adamw(1e-3), BATCH, mesh, device_memory="32GiB")
    assert explored.fits is False and explored.tried and all(other.fits is False for _, other in explored.tried)
    # any other compile error is the user's to see
    monkeypatch.setattr(jax.stages.Lowered, "compile",
                        lambda self, *a, **k: (_ for _ in ()).throw(jax.errors.JaxRuntimeError("INTERNAL: boom")))
    with pytest.raises(jax.errors.JaxRuntimeError, match="boom"):
        redeqx.plan(make, lm_loss, optax.adamw(1e-3), BATCH, mesh)


@pytest.mark.slow
def test_auto_plans_each_candidate_once_and_explores_only_at_the_end(monkeypatch):
    """Before: make_mesh("auto", planner=partial(redeqx.plan, ...)) ran plan's
    whole exploration (a dozen compiles) for every candidate that did not fit,
    its "tried" list showed fsdp=True twice, kept options that raised the
    peak, and said "more devices are needed" without trying the most model
    shards the devices allow."""
    from redeqx.planner import _explore, _plan

    compiles = []
    real = _plan._one_plan
    monkeypatch.setattr(_plan, "_one_plan", lambda *a, **k: compiles.append(a[4].shape["model"]) or real(*a, **k))
    devices = jax.devices()[:4]
    # big_params: the program's plan is the names' at every candidate (no second compile to compare them)
    planner = functools.partial(redeqx.plan, big_params, lm_loss, optax.adamw(1e-3), BATCH, device_memory=4096)
    with pytest.raises(ValueError, match="no n_model_shards fits on these 4 devices") as e:
        redeqx.make_mesh("auto", devices=devices, planner=planner)
    assert compiles[:3] == [1, 2, 4], compiles
    assert len(compiles) <= 3 + 12, compiles  # one exploration, at the last candidate
    assert "what redeqx.plan tried" in str(e.value)

    tried = str(e.value).split("tried:\n")[1].split("\nnothing tried fits")[0].splitlines()
    labels = [line.split(" peak ")[0].strip() for line in tried]
    assert labels and len(labels) == len(set(labels)), labels  # fsdp=True was listed twice
    settings = dict(fsdp=False, remat=False, accumulate=1, compute_dtype=None, opt_state_dtype=None)
    options = [label for label, _, _ in _explore.options(settings, redeqx.make_mesh(1, devices=devices), 16)]
    assert "n_model_shards=2" in options and "n_model_shards=4" in options, options  # the most there are, too


def test_a_plan_names_the_compiler_whose_figures_it_gives():
    """Before: XLA:CPU's figures were printed as if they were the device's, bfloat16 compute included
    (whose peak XLA:CPU counts through float32 temporaries: it rose where a GPU's fell)."""
    p = redeqx.plan(make, lm_loss, optax.adamw(1e-3), BATCH, redeqx.make_mesh(2), compute_dtype=jnp.bfloat16)
    assert p.compiler == "XLA:CPU (cpu)"
    text = str(p)
    assert "figures from XLA:CPU (cpu)" in text.splitlines()[1]
    assert "XLA:CPU computes bfloat16 math through float32 temporaries" in text
    assert "bfloat16 math" not in str(redeqx.plan(make, lm_loss, optax.adamw(1e-3), BATCH, redeqx.make_mesh(2)))


@pytest.mark.slow
def test_plan_searches_accumulation_down_to_one_row_before_asking_for_devices(compile_each_setting_once):
    """Before: after trying accumulate=2 alone and in the combination, the planner said "more
    devices are needed", though the combination with a smaller micro-batch fits (the 1B LLaMA at
    24 GB: remat + a bfloat16 optimizer state + accumulate=8)."""
    mesh = redeqx.make_mesh(1, devices=jax.devices()[:1])  # one device: no more shards to try
    batch = {"tokens": jax.ShapeDtypeStruct((16, 33), jnp.int32)}  # activations outweigh the parameters
    chosen = dict(remat=True, opt_state_dtype=jnp.bfloat16, compute_dtype=jnp.bfloat16)
    planner = functools.partial(redeqx.plan, make, lm_loss, optax.adamw(1e-3), batch, mesh, **chosen)
    peaks = {k: planner(accumulate=k, explore=False).peak for k in (4, 8)}
    assert peaks[8] < peaks[4]
    p = planner(device_memory=(peaks[4] + peaks[8]) // 2)
    labels = [label for label, _ in p.tried]
    assert labels == ["fsdp=True", "accumulate=2", "accumulate=4", "accumulate=8"], labels  # the least that fits
    assert [other.fits for _, other in p.tried] == [False, False, False, True]
    assert p.tried[-1][1].peak == peaks[8] and "would fit with: accumulate=8" in str(p)
    hopeless = planner(device_memory=4096)  # down to one row per micro-batch, then more devices
    assert [label for label, _ in hopeless.tried][-1] == "accumulate=16" and "more devices are needed" in str(hopeless)


MLP_SWAPPED = [(r"mlp\.fc1\.weight", P(None, "model")), (r"mlp\.fc1\.bias", P()), (r"mlp\.fc2\.weight", P("model"))]


def _counting(monkeypatch):
    from redeqx.planner import _explore, _plan

    compiles = []
    real = _plan._one_plan
    monkeypatch.setattr(_plan, "_one_plan", lambda *a, **k: compiles.append(a[6].get("specs")) or real(*a, **k))
    return compiles


@pytest.mark.slow
def test_a_plan_that_moves_more_bytes_than_the_names_plan_warns_saying_which(monkeypatch):
    """Before: nothing said when the specs planned moved more bytes than the names' plan (the
    program's plan of a review's UNet moved 2.03x the hand plan's, in silence); plan took no specs."""
    mesh = redeqx.make_mesh(2)
    model = eqx.filter_eval_shape(make, jax.random.key(0))
    # the names' plan with the MLP's Megatron pair turned around: row then column parallel
    bad = redeqx.sharding_rules(model, mesh, overrides=MLP_SWAPPED)
    compiles = _counting(monkeypatch)
    with pytest.warns(UserWarning, match=r"the specs given move .* the names' plan") as record:
        p = redeqx.plan(make, lm_loss, optax.adamw(1e-3), BATCH, mesh, specs=bad, explore=False)
    assert len(compiles) == 2 and compiles[0] is bad  # the step with these specs, then with the names'
    names = redeqx.plan(make, lm_loss, optax.adamw(1e-3), BATCH, mesh, specs=redeqx.sharding_rules(model, mesh),
                        explore=False)
    moved, names_moved = (sum(v["bytes"] for v in q.collectives.values()) for q in (p, names))
    assert moved > 1.05 * names_moved
    text = str(record[0].message)
    assert human_bytes(moved) in text and human_bytes(names_moved) in text, text
    assert "blocks.0.mlp.fc1.weight" in text and "blocks.0.mlp.fc2.weight" in text and "attn" not in text, text
    assert p.warnings == (text[len("redeqx.plan: "):],) and f"warning: {p.warnings[0]}" in str(p)
    with pytest.raises(ValueError, match="got specs= and fsdp=True"):
        redeqx.plan(make, lm_loss, optax.adamw(1e-3), BATCH, mesh, specs=bad, fsdp=True)


def test_a_plan_that_agrees_with_the_names_plan_compiles_once_and_says_nothing(monkeypatch, recwarn):
    mesh = redeqx.make_mesh(2)
    compiles = _counting(monkeypatch)
    # the program's plan is the names' here (with make's 128-token table, whole moves fewer bytes than split)
    p = redeqx.plan(big_params, lm_loss, optax.adamw(1e-3), BATCH, mesh)
    assert len(compiles) == 1 and p.warnings == () and "warning:" not in str(p)
    assert not [w for w in recwarn if "redeqx.plan" in str(w.message)]


def test_the_program_reader_reads_a_long_tuples_operands_past_its_index_comments():
    """Compiled text writes ``/*index=5*/`` before a long tuple's sixth operand; read as operands, the
    comment's words shifted every later element (a loop counter's place in its tuple, and so a trip
    count read off the loop), and a GPU program's kernel bytes looked up an operand named "index"."""
    from redeqx.planner._hlo import parse_module

    text = """ENTRY %m (a: f32[2], b: s32[]) -> (f32[2], f32[2], f32[2], f32[2], f32[2], s32[]) {
  %a = f32[2]{0} parameter(0)
  %b = s32[] parameter(1)
  ROOT %t = (f32[2]{0}, f32[2]{0}, f32[2]{0}, f32[2]{0}, f32[2]{0}, /*index=5*/s32[]) tuple(%a, %a, %a, %a, %a, /*index=5*/%b)
}"""
    computations, _, entry = parse_module(text)
    assert computations[entry][-1].operands == ("a",) * 5 + ("b",)


def test_wrong_units_and_counts_are_named():
    """40 meant 40 GB (it was 40 bytes: a search of 11 compiles ending in "more devices are needed"),
    '200Gb/s' is in bits (it was read as 200 GB/s), a host count must divide the devices (0 was a
    ZeroDivisionError, 3 of 8 accepted), and a model without arrays is named as such."""
    from redeqx.planner._timing import parse_bytes
    from redeqx.planner._timing import parse_rate, seconds

    for wrong in (40, 0.5, "0GB", "1000B"):
        with pytest.raises(ValueError, match=r"under a KiB: give bytes \(40e9 for 40 GB\)"):
            parse_bytes(wrong)
    assert parse_bytes(np.int64(40e9)) == 40 * 10**9 and parse_bytes("32GiB") == 32 * 2**30
    assert parse_rate("200Gb/s", "between_hosts") == parse_rate("25GB/s", "between_hosts") == 25e9
    a_plan = types.SimpleNamespace(mesh={"data": 4, "model": 2})  # what is checked before anything is computed
    for hosts in (0, 3):
        with pytest.raises(ValueError, match=rf"devices_per_host={hosts}: give how many of the plan's 8 devices"):
            seconds(a_plan, flops_per_second="1TFLOP/s", devices_per_host=hosts, within_host="450GB/s",
                    between_hosts="25GB/s")
    with pytest.raises(ValueError, match=r"model \(.*\) holds no array"):
        redeqx.plan({"n": 3}, lm_loss, optax.adamw(1e-3), BATCH, redeqx.make_mesh(2))
