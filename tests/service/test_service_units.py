"""In-process units: validation, the batcher, settings and the server core without HTTP."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import struct
import subprocess
import sys
import time

import pytest
import torch
from server_harness import H, HV, K, LAYERS, ROOT, SLOTS, TOL, V, make_sequence, metric, reference, rel

from service.http.app import create_app
from service.core.batcher import Batcher
from service.config import Settings, parse_settings
from service.core.server import ServerCore
from service.errors import InvalidRequest, NotReady
from service.core.gate_params import Gate, load_gate_params
from service.core.inputs import PARAM_NAMES, REQUIRED_TENSORS, PrefillInputs, PrefillParams
from service.core.metrics import Metrics
from service.core.validation import all_finite, finite_flags, validate_prefill
from service.core.worker import DeviceWorker
from state_store import PoolFull, PoolGeometry, UnknownSlot

GEOMETRY = PoolGeometry(LAYERS, SLOTS, HV, K, V, torch.float32, torch.device("cpu"))


def replaced(x: PrefillInputs, **changes) -> PrefillInputs:
    """``x`` with ``changes`` to its fields or its params' (by name)."""
    params = {n: changes.pop(n) for n in list(changes) if n in PARAM_NAMES}
    return dataclasses.replace(x, params=dataclasses.replace(x.params, **params), **changes)


def inputs(gen: torch.Generator, lengths=(5, 4), **replace) -> PrefillInputs:
    tensors = dict(zip(REQUIRED_TENSORS, make_sequence(sum(lengths), gen)))
    return replaced(PrefillInputs.of(PrefillParams(layer=0), [None] * len(lengths), lengths, tensors), **replace)


def test_valid_prefill(gen):
    valid = validate_prefill(inputs(gen, dt_bias=torch.zeros(HV * K), A_log=torch.zeros(HV)), GEOMETRY, {})
    assert valid.heads == H and valid.tokens == 9 and valid.gate.dt_bias.shape == (HV, K)


def test_batch_keys_separate_what_cannot_share_a_launch(gen):
    def key(**replace):
        return validate_prefill(inputs(gen, **replace), GEOMETRY, {}).batch_key

    assert key() == key()  # different tensors, same options: one launch
    assert key(A_log=torch.zeros(HV)) == key(A_log=torch.zeros(HV))
    assert key(A_log=torch.zeros(HV)) != key(A_log=torch.ones(HV))
    assert key() != key(layer=1)
    assert key() != key(use_qk_l2norm=True)
    assert key() != key(scale=0.5)
    assert key() != key(lower_bound=-1.0)


@pytest.mark.parametrize("replace,field", [
    (dict(layer=LAYERS), "layer"),
    (dict(slots=["a"], lengths=[9]), None),  # fine: named slots are checked by the pool, not here
    (dict(slots=["a", "a"]), "sequences[1].slot"),
    (dict(slots=[None] * 3), "sequences"),
    (dict(lengths=[9, 0], slots=[None, None]), "sequences[1].length"),
    (dict(lengths=[4, 4]), "sequences"),
    (dict(q=lambda b: b.q.double()), "q"),
    (dict(beta=lambda b: b.beta[:, :, None]), "beta"),
    (dict(g=lambda b: b.g[:, :2]), "g"),
    (dict(v=lambda b: b.v[:8]), "v"),
    (dict(k=lambda b: b.k[:, :1]), "k"),
    (dict(dt_bias=torch.zeros(HV, K)), "dt_bias"),
    (dict(A_log=torch.zeros(HV, 1)), "A_log"),
    (dict(lower_bound=float("nan")), "lower_bound"),
    (dict(scale=float("inf")), "scale"),
    (dict(scale=0.0), "scale"),
    (dict(g=lambda b: b.g.clone().fill_(float("-inf"))), "g"),
])
def test_invalid_prefills_name_the_field(gen, replace, field):
    """Each change to a valid request (lengths 5 + 4, T = 9) and the field it must blame."""
    base = inputs(gen)
    x = replaced(base, **{n: (v(base) if callable(v) else v) for n, v in replace.items()})
    if field is None:
        validate_prefill(x, GEOMETRY, {})
        return
    with pytest.raises(InvalidRequest) as e:
        validate_prefill(x, GEOMETRY, {})
    assert e.value.field == field and e.value.status == 400


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_all_finite_finds_one_bad_value_anywhere(dtype, bad):
    """The one-pass scan (min and max) sees a single NaN or Inf at the start, middle or end
    of large, odd-sized and strided tensors, and passes finite ones and empty ones."""
    gen = torch.Generator().manual_seed(3)
    for n in (1, 63, 100_003):
        assert all_finite(torch.randn(n, generator=gen).to(dtype))
        for pos in {0, n // 2, n - 1}:
            x = torch.randn(n, generator=gen).to(dtype)
            x[pos] = bad
            assert not all_finite(x), (n, pos)
    strided = torch.randn(4, 6, 8, generator=gen).to(dtype)[:, ::2]
    strided[3, 2, 7] = bad
    assert not all_finite(strided)
    assert all_finite(torch.empty(0, 3, dtype=dtype))


@pytest.mark.parametrize("bad", ["nan in v", "inf in beta", "a growing log decay", "none now"])
def test_a_failed_input_check_is_named_by_a_scan_of_the_inputs(gen, bad):
    """`failed_input_problem`: after a launch's input check failed, the first failing input
    is named with what was seen; when none fails any more (a client wrote into inputs read
    in place during the run) the 400 says so instead of passing the run."""
    from service.core.validation import failed_input_problem

    named = [(name, torch.randn(12, 2, 4, generator=gen)) for name in ("q", "k", "v")]
    named += [("g", -torch.rand(12, 2, 4, generator=gen)), ("beta", torch.rand(12, 2, generator=gen))]
    tensors = dict(named)
    if bad == "nan in v":
        tensors["v"][3, 1, 2] = float("nan")
    elif bad == "inf in beta":
        tensors["beta"][7, 0] = float("inf")
    elif bad == "a growing log decay":
        tensors["g"][0, 0, 0] = 0.25
    problem = failed_input_problem(named, log_decay=True)
    assert isinstance(problem, InvalidRequest) and problem.status == 400
    field, words = {"nan in v": ("v", "non-finite"), "inf in beta": ("beta", "non-finite"),
                    "a growing log decay": ("g", "0.25"), "none now": ("inputs", "changed during the run")}[bad]
    assert problem.field == field and words in problem.detail, problem.detail


def test_server_gates_take_over_the_layer(gen):
    server = {0: Gate(A_log=torch.zeros(HV), key=("server", 0))}
    assert validate_prefill(inputs(gen), GEOMETRY, server).gate is server[0]
    with pytest.raises(InvalidRequest, match="server's gate parameters") as e:
        validate_prefill(inputs(gen, lower_bound=-1.0), GEOMETRY, server)
    assert e.value.field == "lower_bound"
    assert validate_prefill(inputs(gen, layer=1, lower_bound=-1.0), GEOMETRY, server).gate.lower_bound == -1.0


def test_gate_files_load_in_any_float_dtype_the_safetensors_package_writes(tmp_path):
    """fp64 and bf16 entries load as fp32 values; a file that is not safetensors is a
    ValueError naming it."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(5)
    A_log, dt_bias = torch.randn(HV, generator=gen, dtype=torch.float64), torch.randn(HV * K, generator=gen)
    save_file({"layers.0.A_log": A_log, "layers.0.dt_bias": dt_bias.bfloat16(),
               "layers.1.lower_bound": torch.tensor([-2.5], dtype=torch.float64)}, tmp_path / "gates.safetensors")
    gates = load_gate_params(str(tmp_path / "gates.safetensors"), GEOMETRY)
    assert torch.equal(gates[0].A_log, A_log.float()) and gates[0].A_log.dtype == torch.float32
    assert torch.equal(gates[0].dt_bias, dt_bias.bfloat16().float().reshape(HV, K))
    assert gates[1].lower_bound == -2.5 and gates[1].A_log is None
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\0\0\0\0\0\0\0{not json}      ")
    with pytest.raises(ValueError, match="bad.safetensors: not a safetensors file"):
        load_gate_params(str(tmp_path / "bad.safetensors"), GEOMETRY)


def test_a_gate_file_dt_bias_of_the_right_size_but_another_shape_is_refused(tmp_path):
    """dt_bias is [HV, K] or [HV * K]: a [K, HV] entry (a transposed export) holds the same
    number of values, and reshaping it would pair every bias with the wrong head and key."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(6)
    for shape in [(K, HV), (1, HV * K), (HV, K, 1)]:
        path = tmp_path / f"gates_{'x'.join(map(str, shape))}.safetensors"
        save_file({"layers.0.A_log": torch.randn(HV, generator=gen),
                   "layers.0.dt_bias": torch.randn(*shape, generator=gen)}, path)
        with pytest.raises(ValueError, match=rf"layers.0.dt_bias must be \[{HV}, {K}\] or \[{HV * K}\], "
                                             rf"got \[{', '.join(map(str, shape))}\]"):
            load_gate_params(str(path), GEOMETRY)


def test_a_gate_file_with_a_shape_no_tensor_can_have_is_a_value_error(tmp_path):
    """Files go through the one shape check too (`tensor_io.shapes`): [2^63, 0] holds no
    bytes but no tensor can have it; a ValueError naming the file, never torch's TypeError."""
    text = json.dumps({"layers.0.A_log": {"dtype": "F32", "shape": [1 << 63, 0], "data_offsets": [0, 0]}}).encode()
    (tmp_path / "huge.safetensors").write_bytes(struct.pack("<Q", len(text)) + text)
    with pytest.raises(ValueError, match=r"huge.safetensors: not a safetensors file: .*more than 2\^48 elements"):
        load_gate_params(str(tmp_path / "huge.safetensors"), GEOMETRY)


# -- batcher -------------------------------------------------------------------------------

def run_batcher(window_s: float, max_tokens: int, jobs: list[tuple[str, int, object]], fail: set = frozenset()):
    """Submit ``jobs`` (key, tokens, payload) at once; returns (launches, outcomes)."""
    launches: list[list] = []

    def run_batch(batch):
        launches.append(list(batch))
        return [ValueError(j) if j in fail else f"done {j}" for j in batch]

    async def main():
        worker = DeviceWorker(torch.device("cpu"))
        batcher = Batcher(run_batch, worker, Metrics(lambda: 0), window_s=window_s, max_tokens=max_tokens)
        batcher.start()
        outcomes = await asyncio.gather(*(batcher.submit(key, n, j) for key, n, j in jobs), return_exceptions=True)
        await batcher.close()
        worker.close()
        return outcomes

    return launches, asyncio.run(main())


def test_batcher_merges_same_key_within_the_window():
    launches, outcomes = run_batcher(0.05, 1000, [("a", 1, 1), ("b", 1, 2), ("a", 1, 3), ("a", 1, 4)])
    assert launches == [[1, 3, 4], [2]]  # oldest key first, arrival order kept
    assert outcomes == ["done 1", "done 2", "done 3", "done 4"]


def test_batcher_respects_max_tokens_and_isolates_failures():
    launches, outcomes = run_batcher(0.05, 10, [("a", 6, 1), ("a", 4, 2), ("a", 3, 3), ("a", 20, 4)], fail={2})
    assert launches == [[1, 2], [3], [4]]  # a job over the cap still runs, alone
    assert isinstance(outcomes[1], ValueError) and outcomes[0] == "done 1" and outcomes[3] == "done 4"


def test_batcher_without_window_launches_at_once():
    start = time.monotonic()
    launches, _ = run_batcher(0.0, 1000, [("a", 1, 1)])
    assert launches == [[1]] and time.monotonic() - start < 0.5


def run_inline_batcher(jobs: list[tuple[str, int, object]], inline_tokens: int):
    """Submit ``jobs`` at once to a batcher with no window that may launch inline; returns
    (launches, the thread each ran on, outcomes)."""
    import threading

    launches: list[list] = []
    threads: list[str] = []

    def run_batch(batch):
        launches.append(list(batch))
        threads.append(threading.current_thread().name)
        return [f"done {j}" for j in batch]

    async def main():
        worker = DeviceWorker(torch.device("cpu"))
        batcher = Batcher(run_batch, worker, Metrics(lambda: 0), window_s=0.0, max_tokens=1000,
                          inline_tokens=inline_tokens)
        batcher.start()
        outcomes = await asyncio.gather(*(batcher.submit(key, n, j) for key, n, j in jobs))
        await batcher.close()
        worker.close()
        return outcomes

    outcomes = asyncio.run(main())
    return launches, threads, outcomes


def test_a_lone_small_submission_to_an_idle_device_launches_on_the_loop():
    launches, threads, outcomes = run_inline_batcher([("a", 4, 1)], inline_tokens=8)
    assert launches == [[1]] and threads == ["MainThread"] and outcomes == ["done 1"]
    launches, threads, _ = run_inline_batcher([("a", 9, 1)], inline_tokens=8)  # larger: the device thread
    assert launches == [[1]] and threads[0].startswith("kda-device")


def test_submissions_arriving_together_still_merge_when_inline_is_allowed():
    """The inline path yields once first: requests received in the same turn merge."""
    launches, threads, outcomes = run_inline_batcher([("a", 1, 1), ("a", 1, 2), ("a", 1, 3)], inline_tokens=8)
    assert launches == [[1, 2, 3]] and threads[0].startswith("kda-device")
    assert outcomes == ["done 1", "done 2", "done 3"]


def test_device_worker_runs_inline_only_while_idle():
    import threading

    async def main():
        worker = DeviceWorker(torch.device("cpu"))
        assert worker.idle and worker.run_inline(lambda: threading.current_thread().name) == "MainThread"
        gate = threading.Event()
        busy = asyncio.ensure_future(worker.run(gate.wait))
        await asyncio.sleep(0)
        assert not worker.idle
        with pytest.raises(ValueError, match="device thread has work"):
            worker.run_inline(lambda: None)
        gate.set()
        await busy
        assert worker.idle
        worker.close()

    asyncio.run(main())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_inline_work_runs_as_on_the_device_thread_and_leaves_the_caller_as_it_was(device):
    """`run_inline` runs its function as the device thread runs launches (grad mode off;
    one intra-op thread on a CPU, the caller's count on CUDA), and the calling thread's
    grad mode and thread count are what they were afterwards, after a failure too."""
    inline_threads = 1 if device == "cpu" else 2

    def seen() -> tuple[bool, int]:
        return torch.is_grad_enabled(), torch.get_num_threads()

    def fails() -> None:
        raise RuntimeError("launch failed")

    async def main():
        worker = DeviceWorker(torch.device(device))
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            with torch.enable_grad():
                assert worker.run_inline(seen) == (False, inline_threads)
                assert seen() == (True, 2)
                with pytest.raises(RuntimeError, match="launch failed"):
                    worker.run_inline(fails)
                assert seen() == (True, 2)
            assert (await worker.run(seen))[0] is False  # the device thread itself: grad mode off
        finally:
            torch.set_num_threads(threads)
            worker.close()

    asyncio.run(main())


def test_batcher_refuses_after_close():
    async def main():
        worker = DeviceWorker(torch.device("cpu"))
        batcher = Batcher(lambda b: b, worker, Metrics(lambda: 0), window_s=0, max_tokens=1)
        batcher.start()
        await batcher.close()
        worker.close()
        with pytest.raises(NotReady):
            await batcher.submit("a", 1, 1)

    asyncio.run(main())


# -- settings ------------------------------------------------------------------------------

def test_settings_defaults_env_and_flags():
    assert parse_settings([], {}) == Settings()
    env = {"KDA_NUM_SLOTS": "9", "KDA_HEAD_V_DIM": "32", "KDA_SLOT_TTL_S": "2.5", "KDA_API_KEY": "s3cr3t"}
    s = parse_settings(["--num-slots", "7"], env)
    assert (s.num_slots, s.v_dim, s.slot_ttl_s, s.api_key) == (7, 32, 2.5, "s3cr3t")  # a flag beats its variable
    assert "s3cr3t" not in repr(s)  # the key stays out of logs
    assert Settings(max_body_mb=1).max_body_bytes == 1 << 20


def test_bool_settings_take_the_flag_alone_its_words_and_the_variable():
    assert parse_settings([], {}).cuda_ipc_zero_copy is False
    assert parse_settings(["--cuda-ipc-zero-copy"], {}).cuda_ipc_zero_copy is True
    assert parse_settings(["--cuda-ipc-zero-copy", "off"], {"KDA_CUDA_IPC_ZERO_COPY": "1"}).cuda_ipc_zero_copy is False
    for word, value in (("1", True), ("TRUE", True), ("yes", True), ("0", False), ("false", False), ("No", False)):
        assert parse_settings([], {"KDA_CUDA_IPC_ZERO_COPY": word}).cuda_ipc_zero_copy is value


def test_head_dims_the_kernels_cannot_run_are_refused_in_the_settings():
    """The kernels' limit is checked once, before a pool exists, not at every launch."""
    with pytest.raises(ValueError, match="head dims must be in 1..256, got K=64, V=257"):
        Settings(head_v_dim=257)
    assert Settings(head_dim=256).v_dim == 256


@pytest.mark.parametrize("argv,env", [
    (["--num-slots", "0"], {}), (["--device", "tpu"], {}), (["--state-dtype", "float16"], {}),
    (["--batch-window-ms", "-1"], {}), ([], {"KDA_PORT": "eighty"}), (["--bogus"], {}),
    (["--head-dim", "257"], {}), (["--cuda-ipc-zero-copy", "maybe"], {}), ([], {"KDA_CUDA_IPC_ZERO_COPY": "2"}),
    (["--spare-rows", "-1"], {}), ([], {"KDA_SPARE_ROWS": "some"}),
])
def test_bad_settings_exit_with_usage(argv, env, capsys):
    with pytest.raises(SystemExit) as e:
        parse_settings(argv, env)
    assert e.value.code == 2 and "kda-serve" in capsys.readouterr().err


def test_cli_help_runs_as_a_module():
    r = subprocess.run([sys.executable, "-m", "service.cli", "--help"], cwd=ROOT, capture_output=True, text=True,
                       env={"PYTHONPATH": str(ROOT)}, timeout=120)
    assert r.returncode == 0 and "--max-batch-tokens" in r.stdout and "KDA_NUM_SLOTS" in r.stdout


# -- the core without HTTP -----------------------------------------------------------------

def test_server_core_runs_without_fastapi(gen):
    """ServerCore alone (as a KServe endpoint or a Ray Serve shard would use it)."""
    settings = Settings(num_layers=LAYERS, num_slots=4, num_heads=HV, head_dim=K, head_v_dim=V, batch_window_ms=0)
    seqs = [make_sequence(T, gen) for T in (3, 66)]

    async def main():
        core = ServerCore(settings)
        await core.start()
        await core.warmup()
        try:
            slot = (await core.alloc())[0]
            x = inputs(gen, lengths=(3, 66), slots=[slot, None],
                       **dict(zip(("q", "k", "v", "g", "beta"), (torch.cat(t) for t in zip(*seqs)))))
            result = await core.prefill(x)
            with pytest.raises(UnknownSlot):
                await core.prefill(inputs(gen, slots=["gone", None]))
            assert (await core.info())["free_slots"] == 2  # the refused request allocated nothing
            return result, await core.get_state(result.slots[1])
        finally:
            await core.close()

    result, state = asyncio.run(main())
    o_ref, final_ref = reference(seqs)
    assert result.slots[0] != result.slots[1] and len(result.allocated) == 1
    assert rel(result.o, o_ref) < TOL and rel(result.final_state, final_ref) < TOL
    assert torch.equal(state[0], result.final_state[1])


def test_a_prefill_is_validated_once(gen, monkeypatch):
    """The core validates a request once (`validate_prefill`) and runs the launch's problem
    as built: the kernels' argument checks (`build_problem`) never run on its path, and the
    result still matches the reference."""
    import kernels.api
    import service.core.server as server_module

    settings = Settings(num_layers=LAYERS, num_slots=4, num_heads=HV, head_dim=K, head_v_dim=V, batch_window_ms=0)
    seqs = [make_sequence(T, gen) for T in (5, 70)]
    validations = []

    def counted(*args, **kwargs):
        validations.append(1)
        return validate_prefill(*args, **kwargs)

    def refused(*args, **kwargs):
        raise AssertionError("the kernels' checks ran again on the service's path")

    async def main():
        core = ServerCore(settings)
        await core.start()
        await core.warmup()  # the public chunk_kda, on a scratch pool: checks run here, once per start
        monkeypatch.setattr(kernels.api, "build_problem", refused)
        monkeypatch.setattr(server_module, "validate_prefill", counted)
        try:
            x = inputs(gen, lengths=(5, 70), **dict(zip(("q", "k", "v", "g", "beta"),
                                                        (torch.cat(t) for t in zip(*seqs)))))
            return await core.prefill(x)
        finally:
            await core.close()

    result = asyncio.run(main())
    o_ref, final_ref = reference(seqs)
    assert validations == [1]
    assert rel(result.o, o_ref) < TOL and rel(result.final_state, final_ref) < TOL


def test_server_core_queries_and_restore_slot(gen):
    """The queries front ends use instead of the pool (has_slot, slot_ids, stats), readiness
    after warmup, and restore_slot: a new slot bit for bit with its token counts, a lost one
    flagged and not copied, and all or nothing (a state that does not fit or is not finite,
    a full pool, token counts for a layer the pool lacks)."""
    settings = Settings(num_layers=LAYERS, num_slots=3, num_heads=HV, head_dim=K, head_v_dim=V, batch_window_ms=0)
    state = torch.randn(LAYERS, HV, V, K, generator=gen)

    async def main():
        core = ServerCore(settings)
        await core.start()
        try:
            with pytest.raises(NotReady):
                await core.check_ready()
            await core.warmup()
            await core.check_ready()
            restored = await core.restore_slot(state, [7, 3], False)
            assert core.has_slot(restored) and core.slot_ids() == [restored] and not core.has_slot("nope")
            assert torch.equal(await core.get_state(restored), state)
            info = await core.slot_info(restored)
            assert info.tokens_per_layer == [7, 3] and not info.state_lost
            lost = await core.restore_slot(state, [1, 0], True)
            info = await core.slot_info(lost)
            assert info.state_lost and info.tokens_per_layer == [1, 0]
            assert not (await core.get_state(lost)).any()  # a lost state is not copied
            nan = state.clone()
            nan[1, 2, 3, 4] = float("nan")
            for bad in (state.double(), nan):
                with pytest.raises(InvalidRequest):
                    await core.restore_slot(bad, [0, 0], False)
            await core.alloc(1)
            with pytest.raises(PoolFull):
                await core.restore_slot(state, [0, 0], False)
            assert core.stats().used == 3 and (await core.info())["free_slots"] == 0
            await core.free(lost)
            with pytest.raises(ValueError):  # a count for a layer the pool lacks
                await core.restore_slot(state, [0, 0, 5], False)
            assert core.stats().used == 2  # nothing was left behind
        finally:
            await core.close()

    asyncio.run(main())


def test_reading_an_entrys_bytes_counts_no_prefix_hit_a_restore_does(gen):
    """`ServerCore.prefix_state` hands an entry's bytes to another Ray Serve shard and
    restores no slot: ``kda_prefix_hits_total`` and ``kda_prefix_hit_tokens_total`` stay as
    they were. A restore into slots (`alloc_prefix`, POST /slots with a prefix) counts one
    hit and the entry's tokens for each slot restored."""
    settings = Settings(num_layers=LAYERS, num_slots=4, num_heads=HV, head_dim=K, head_v_dim=V, batch_window_ms=0)
    state = torch.randn(LAYERS, HV, V, K, generator=gen)

    async def hits(core: ServerCore) -> tuple[float, float]:
        page = (await core.render_metrics()).decode()
        return metric(page, "kda_prefix_hits_total"), metric(page, "kda_prefix_hit_tokens_total")

    async def main():
        core = ServerCore(settings)
        await core.start()
        try:
            await core.publish(await core.restore_slot(state, [6] * LAYERS, False), "k")
            assert await hits(core) == (0, 0)
            entry, tokens = await core.prefix_state("k")
            assert tokens == 6 and torch.equal(entry, state)
            assert await hits(core) == (0, 0)
            slots, match = await core.alloc_prefix(["k"], count=2)
            assert match.tokens == 6 and len(slots) == 2
            assert await hits(core) == (1, 12)
        finally:
            await core.close()

    asyncio.run(main())


def test_apps_keep_their_own_metrics():
    """Each app registers on its own registry: two in one process neither clash nor mix."""
    settings = Settings(num_layers=1, num_slots=2, num_heads=2, head_dim=8)
    a, b = create_app(settings), create_app(settings)
    a.state.core.metrics.tokens.inc(5)
    assert b"kda_prefill_tokens_total 5.0" in a.state.core.metrics.render()
    assert b"kda_prefill_tokens_total 0.0" in b.state.core.metrics.render()


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                   reason="needs a CUDA device")]),
])
def test_finite_flags_names_each_bad_tensor_of_a_mixed_list(device: str) -> None:
    """One flag per tensor, in order, over dtypes and sizes mixed in one list (on a GPU the
    flags of all of them are read back together)."""
    gen = torch.Generator().manual_seed(7)
    good = [torch.randn(300, 4, 64, generator=gen).to(dt) for dt in (torch.float32, torch.bfloat16, torch.float16)]
    nan, inf = torch.randn(1000, generator=gen), torch.randn(5, 3, generator=gen).to(torch.bfloat16)
    nan[777], inf[4, 2] = float("nan"), float("-inf")
    tensors = [t.to(device) for t in (good[0], nan, good[1], torch.empty(0), inf, good[2])]
    assert finite_flags(tensors) == [True, False, True, True, False, True]
    assert finite_flags([]) == []


def test_device_gates_copy_each_gate_once_and_keep_the_most_recent() -> None:
    """`DeviceGates` hands back the gate's values on its device, the same tensors again for
    a key it holds (no second copy), drops the least recently used key past its capacity,
    and copies a keyless gate every time. The "meta" device makes every copy a new tensor."""
    from service.core.gate_params import DeviceGates, Gate, gate_key

    gen = torch.Generator().manual_seed(3)
    gates = []
    for _ in range(3):
        a, d = torch.randn(4, generator=gen), torch.randn(4, 8, generator=gen)
        gates.append(Gate(a, d, -5.0, key=gate_key(a, d, -5.0)))
    on_cpu = DeviceGates(torch.device("cpu")).tensors(gates[0])
    assert torch.equal(on_cpu[0], gates[0].A_log) and torch.equal(on_cpu[1], gates[0].dt_bias)
    held = DeviceGates(torch.device("meta"), capacity=2)
    first = held.tensors(gates[0])
    assert first[0].device.type == "meta" and first[1].shape == (4, 8)
    assert all(x is y for x, y in zip(held.tensors(gates[0]), first))
    second = held.tensors(gates[1])
    held.tensors(gates[0])  # gates[0] the most recent: gates[1] goes next
    held.tensors(gates[2])
    assert all(x is y for x, y in zip(held.tensors(gates[0]), first))
    assert held.tensors(gates[1])[0] is not second[0]  # dropped, so copied afresh
    keyless = Gate(gates[0].A_log, None, None, key=None)
    assert held.tensors(keyless)[0] is not held.tensors(keyless)[0]


def test_share_bytes_finds_views_of_one_region_that_overlap() -> None:
    """`prepared.share_bytes`, which keeps the kernels from writing o over inputs they read
    in place: views of one buffer overlap exactly when their byte spans meet (strided and
    reshaped views included); neighbours that only touch, another buffer and an empty
    view do not."""
    from service.core.prepared import share_bytes

    region = torch.zeros(1024, dtype=torch.uint8)
    q = region[0:256].view(torch.bfloat16).view(8, 2, 8)
    o = region[256:512].view(torch.bfloat16).view(8, 2, 8)
    assert not share_bytes(q, o) and not share_bytes(o, q)  # adjacent: byte 255 and byte 256
    assert share_bytes(region[255:511].view(8, 32), q) and share_bytes(q, region[255:511])
    strided = region[100:612:2]  # every other byte from 100 to 610: spans q's tail and o
    assert share_bytes(strided, q) and share_bytes(strided, o)
    assert not share_bytes(region[0:0], q)
    assert not share_bytes(torch.zeros(256, dtype=torch.uint8), q)


def test_a_snapshot_renamed_in_but_not_durable_moves_the_generation_gauge(tmp_path, monkeypatch):
    """The pool's file was renamed in, then the directory's fsync failed (SnapshotNotDurable):
    the disk may hold the new generation, under which later changes are journaled, so
    ``kda_snapshot_generation`` says that generation, and the failure is counted."""
    import state_store.snapshot as snapshot_module
    from state_store.errors import SnapshotNotDurable

    def failing_fsync(directory: str) -> None:
        raise OSError("injected: the directory's fsync failed")

    async def main() -> None:
        core = ServerCore(Settings(device="cpu", backend="torch", num_layers=LAYERS, num_slots=2, num_heads=HV,
                                   head_dim=K, head_v_dim=V, snapshot_path=str(tmp_path / "pool.snap"),
                                   snapshot_interval_s=0))
        await core.start()
        try:
            sample = core.metrics.registry.get_sample_value
            assert await core.checkpoint(force=True) == 1 and sample("kda_snapshot_generation") == 1
            monkeypatch.setattr(snapshot_module, "fsync_directory", failing_fsync)
            with pytest.raises(SnapshotNotDurable):
                await core.checkpoint(force=True)
            assert core.persistence.generation == 2
            assert sample("kda_snapshot_generation") == 2 and sample("kda_snapshot_failures_total") == 1
        finally:
            monkeypatch.undo()
            await core.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_the_journal_gauges_follow_its_size_and_compactions(tmp_path):
    """``kda_journal_bytes`` is the pool journal's size and ``kda_journal_compactions_total``
    the times it was compacted (read at each scrape from the persistence), both 0 without a
    journal's growth, and both follow frees and a compaction."""
    from state_store import Persistence, StatePool

    pool = StatePool(LAYERS, 4, HV, K, V)
    persistence = Persistence(pool, tmp_path / "pool.snap", compact_min_bytes=512)
    persistence.restore()
    metrics = Metrics(free_slots=lambda: pool.stats().free)
    metrics.watch_journal(persistence)
    sample = metrics.registry.get_sample_value
    assert sample("kda_journal_bytes") == 0 and sample("kda_journal_compactions_total") == 0
    for _ in range(40):  # ~60 bytes a free: past 512 bytes, so compacted at least once
        (slot,) = pool.alloc(1)
        persistence.freeing(slot)
        pool.free(slot)
        assert sample("kda_journal_bytes") == persistence.journal_size == (tmp_path / "pool.snap.journal").stat().st_size
    assert sample("kda_journal_compactions_total") == persistence.compactions >= 1
    persistence.close()
