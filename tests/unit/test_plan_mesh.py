"""The plan over a mesh of ranks: per-rank memory, KV replication, collective bytes, proposals, CLI.

No hardware and no process group: everything here is arithmetic on the config and the checkpoint's
shapes. The collective byte counts are checked against hand-computed sums of the ``Comm`` calls
that ``MuseModel`` makes (musecore/model.py); the 2-rank gloo comparison with ``Comm.traffic``
lives with the distributed tests.
"""

import json

import pytest

import musecore
from musecore.cli import main
from musecore.distributed import Mesh, MeshError
from musecore.planning_mesh import (COLLECTIVES, collective_bytes, collective_bytes_total, collective_steps,
                                    sequence_parallel)
from tests.helpers import small_config

BIG = "muse-spark-open-816b-a42b"
GiB = 2**30


def tiny_mesh_config(**overrides):
    """4 sparse layers, H=64, h=32, V=96, 4 query heads of 16, 2 KV heads, 6 experts, top-2."""
    return small_config(vocab_size=96, **overrides)


# -- collective bytes, by hand ----------------------------------------------------------------------

def test_decode_bytes_of_tp2_ep2_replicated_moe():
    """Decode (1 token <= MUSECORE_MOE_REPLICATED_TOKENS): every token on every rank, one all-reduce of the
    per-slot expert outputs per MoE layer (Comm.combine_replicated); the same bytes on both ranks."""
    cfg, dt = tiny_mesh_config(), 2
    N, L, H, h, V, k, q = 1, 4, 64, 32, 96, 2, 4 * 16
    per_layer_gather = (N * q // 2 * dt      # gather_cols of this rank's heads' outputs
                        + N * H // 2 * dt    # gather_cols of o_proj's output rows
                        + N * h // 2 * dt    # gather_cols of the pooler's output columns
                        + N * H // 2 * dt)   # gather_cols of the unpooler's output rows
    logits = N * V // 2 * 4
    want = {"all_reduce": L * N * k * h * 4, "all_gather": L * per_layer_gather + logits, "reduce_scatter": 0,
            "all_to_all": 0}
    got = [collective_bytes(cfg, Mesh(2, 2), 1, dt, rank=r) for r in (0, 1)]
    assert got == [want, want], got


def test_decode_bytes_of_tp2_ep2_are_the_sum_of_the_comm_calls(monkeypatch):
    """The all-to-all path (forced for every size with MUSECORE_MOE_REPLICATED_TOKENS=0)."""
    monkeypatch.setenv("MUSECORE_MOE_REPLICATED_TOKENS", "0")
    cfg, dt = tiny_mesh_config(), 2  # bf16 activations
    N, L, H, h, V, k, q = 1, 4, 64, 32, 96, 2, 4 * 16
    per_layer_gather = (N * q // 2 * dt      # gather_cols of this rank's heads' outputs
                        + N * H // 2 * dt    # gather_cols of o_proj's output rows
                        + 1 * h * dt         # gather_tokens of the expert sums, c = 1 row
                        + N * H // 2 * dt)   # gather_cols of the unpooler's output rows
    logits = N * V // 2 * 4                  # gather_cols of the fp32 logits
    pooler = N * h // 2 * dt                 # cols_to_tokens of the pooler's output columns
    dispatch = 1 * k * h * dt + 1 * k * 4    # rank 0 holds the token: its k routed rows and int32 ids
    combine = 1 * k / 2 * h * 4              # fp32 rows back; expected k/2 of them on each rank
    want0 = {"all_reduce": 0, "all_gather": L * per_layer_gather + logits, "reduce_scatter": 0,
             "all_to_all": L * (pooler + dispatch + combine)}
    want1 = {**want0, "all_to_all": L * (pooler + combine)}  # rank 1 has no token to dispatch
    got = [collective_bytes(cfg, Mesh(2, 2), 1, dt, rank=r) for r in (0, 1)]
    assert got == [want0, want1], got
    assert want0 == {"all_reduce": 0, "all_gather": 1216, "reduce_scatter": 0, "all_to_all": 1184}


def test_sequence_parallel_prefill_bytes_by_hand_with_uneven_token_shards():
    cfg, dt = tiny_mesh_config(), 2
    N, L, H, h, V, k, q = 5, 4, 64, 32, 96, 2, 4 * 16
    c = 3  # ceil(5 / 2): rank 0 holds tokens 0..2, rank 1 tokens 3..4 (padded to 3 in a gather)
    assert sequence_parallel(Mesh(2, 2, sp=True), tokens=5) and not sequence_parallel(Mesh(2, 2, sp=True), tokens=1)
    attention_gather = c * H * dt + N * q // 2 * dt   # gather_tokens before QKV, gather_cols of the heads
    attention_a2a = N * H // 2 * dt                   # o_proj's output rows to their token shards
    moe_gather = c * H * dt + c * h * dt              # gather_tokens of the MoE input and of the expert sums
    final = c * H * dt + N * V // 2 * 4               # the final norm's output, then the fp32 logits
    combine = (3 + 2) * k / 2 * h * 4                 # both ranks' rows, half of them back to each rank
    moe_a2a = {0: N * h // 2 * dt + 3 * k * h * dt + 3 * k * 4 + combine + N * H // 2 * dt,
               1: N * h // 2 * dt + 2 * k * h * dt + 2 * k * 4 + combine + N * H // 2 * dt}
    for rank in (0, 1):
        got = collective_bytes(cfg, Mesh(2, 2, sp=True), N, dt, rank=rank)
        want = {"all_reduce": 0, "all_gather": L * (attention_gather + moe_gather) + final, "reduce_scatter": 0,
                "all_to_all": L * (attention_a2a + moe_a2a[rank])}
        assert got == want, (rank, got, want)


def test_expert_parallel_alone_moves_only_the_routed_rows_and_the_expert_sums(monkeypatch):
    monkeypatch.setenv("MUSECORE_MOE_REPLICATED_TOKENS", "0")
    cfg, dt = tiny_mesh_config(), 2
    got = [collective_bytes(cfg, Mesh(tp=1, ep=2), 1, dt, rank=r) for r in (0, 1)]
    gather = 4 * (1 * 32 * dt)                                    # the expert sums, per layer
    assert got[0] == {"all_reduce": 0, "all_gather": gather, "reduce_scatter": 0,
                      "all_to_all": 4 * (2 * 32 * dt + 2 * 4 + 1 * 32 * 4)}, got
    assert got[1] == {"all_reduce": 0, "all_gather": gather, "reduce_scatter": 0, "all_to_all": 4 * (1 * 32 * 4)}, got


def test_dense_mlp_layers_gather_their_activation_and_output_columns(monkeypatch):
    monkeypatch.setenv("MUSECORE_MOE_REPLICATED_TOKENS", "0")  # the all-to-all path
    sparse_only = tiny_mesh_config()
    mixed = tiny_mesh_config(mlp_layer_types=["dense", "sparse", "sparse", "dense"])
    a = collective_bytes(sparse_only, Mesh(2, 2), 1, 2)
    b = collective_bytes(mixed, Mesh(2, 2), 1, 2)
    moe_gather = 1 * 32 * 2 + 1 * 32 * 2                  # expert sums + unpooler columns, per sparse layer
    dense_gather = 1 * 96 // 2 * 2 + 1 * 64 // 2 * 2      # silu(gate)*up columns + down_proj output rows
    assert b["all_gather"] - a["all_gather"] == 2 * (dense_gather - moe_gather), (a, b)
    moe_a2a = 1 * 16 * 2 + 2 * 32 * 2 + 2 * 4 + 1 * 32 * 4  # pooler, dispatch rows + ids, combine
    assert a["all_to_all"] - b["all_to_all"] == 2 * moe_a2a, (a, b)


@pytest.mark.parametrize("mesh", [Mesh(2, 2), Mesh(2, 2, sp=True), Mesh(1, 2), Mesh(4, 2), Mesh(4, 4, sp=True)])
@pytest.mark.parametrize("tokens,batch", [(1, 1), (1, 3), (7, 1), (5, 2)])
def test_the_combine_summed_over_ranks_is_every_routed_row_whatever_the_routing(mesh, tokens, batch, monkeypatch):
    monkeypatch.setenv("MUSECORE_MOE_REPLICATED_TOKENS", "0")  # the all-to-all path at every size
    cfg = tiny_mesh_config(num_local_experts=8, num_attention_heads=8, num_key_value_heads=2, head_dim=8)
    n, sparse, h, k = tokens * batch, 4, 32, 2
    combine = sum(s.bytes for r in range(mesh.world)
                  for s in collective_steps(cfg, mesh, tokens, 2, batch, rank=r) if s.what.startswith("combine"))
    assert combine == n * k * h * 4 * sparse, (combine, n * k * h * 4 * sparse)
    total = collective_bytes_total(cfg, mesh, tokens, 2, batch)
    per_rank = [collective_bytes(cfg, mesh, tokens, 2, batch, rank=r) for r in range(mesh.world)]
    for name in COLLECTIVES:  # rounding of the per-rank expectation is at most half a byte per rank
        assert abs(total[name] - sum(p[name] for p in per_rank)) <= mesh.world / 2, (name, total, per_rank)


def test_one_rank_sends_nothing():
    assert collective_bytes(tiny_mesh_config(), Mesh(1, 1), 9, 2) == dict.fromkeys(COLLECTIVES, 0)


# -- per-rank memory and KV -------------------------------------------------------------------------

def test_experts_shrink_by_the_world_size_and_replicated_parts_do_not():
    one = musecore.plan(BIG, "h200", emulate=True, checkpoint_format="nvfp4")
    total = {}
    for g in one.groups:
        total[g.group] = total.get(g.group, 0) + g.bytes
    for world in (4, 8, 16):
        mesh = musecore.plan(BIG, "h200", emulate=True, checkpoint_format="nvfp4", tp=world, ep=world).mesh
        by_group = mesh.weight_bytes_by_group
        for group in ("experts (quantized layers)", "experts (BF16 layers)", "attention", "lm_head",
                      "pooler/unpooler"):
            # exact: every split divides its dimension, and a format's bytes are linear in the rows kept
            assert by_group[group] * world == total[group], (world, group, by_group[group], total[group])
        for group in ("embedding", "router"):  # replicated on every rank
            assert by_group[group] == total[group], (world, group, by_group[group], total[group])
        assert mesh.weight_bytes == sum(by_group.values())


def test_kv_heads_replicate_when_tp_exceeds_them():
    tiny = [musecore.plan("muse-tiny", "cpu", tp=tp, ep=tp).mesh for tp in (2, 4)]  # 2 KV heads
    assert (tiny[0].kv_heads, tiny[0].kv_replication) == (1, 1.0), tiny[0]
    assert (tiny[1].kv_heads, tiny[1].kv_replication) == (1, 2.0), tiny[1]
    assert tiny[0].kv_bytes == tiny[1].kv_bytes  # one KV head per rank either way
    assert any("tp=4 exceeds the 2 KV heads" in n for n in tiny[1].notes), tiny[1].notes
    whole = musecore.plan("muse-tiny", "cpu")
    assert tiny[0].kv_bytes * 2 == whole.memory_bytes - sum(g.bytes for g in whole.groups)
    big = musecore.plan(BIG, "h200", emulate=True, checkpoint_format="nvfp4", tp=32, ep=32).mesh  # 16 KV heads
    assert (big.kv_heads, big.kv_replication) == (1, 2.0), (big.kv_heads, big.kv_replication)
    assert not any("KV heads:" in n for n in musecore.plan(BIG, "h200", emulate=True, tp=16, ep=16).mesh.notes)


def test_kv_heads_replicate_when_tp_does_not_divide_them():
    from musecore.planning_mesh import kv_bytes_per_rank
    cfg = small_config(vocab_size=96, hidden_size=96, num_attention_heads=12, num_key_value_heads=3)  # 4 per KV head
    heads, per_rank = kv_bytes_per_rank(cfg, Mesh(2, 2), 100, "bf16")
    _, one_head = kv_bytes_per_rank(small_config(vocab_size=96, num_attention_heads=4, num_key_value_heads=4),
                                    Mesh(4, 2), 100, "bf16")
    assert heads == 3 and per_rank == 3 * one_head, (heads, per_rank, one_head)  # 6 slots for 3 heads: 2x


def test_attention_replicated_with_tp1_caches_every_kv_head_on_every_rank():
    mesh = musecore.plan("muse-tiny", "cpu", ep=2).mesh
    assert (mesh.tp, mesh.ep, mesh.kv_heads, mesh.kv_replication) == (1, 2, 2, 2.0), mesh
    assert any("replicated" in n for n in mesh.notes)


# -- proposals for the 816B model -------------------------------------------------------------------

@pytest.mark.parametrize("device,fmt,label,nodes,recipe", [
    ("h200", "bf16", "TP16/EP16", 2, "TP16/EP16 on two 8x H200 nodes"),
    ("h200", "nvfp4", "TP8/EP8", 1, "one 8x H200 node"),
    ("mi355x", "mxfp4", "TP4/EP4", 1, "TP8/EP8 on 8x MI355X"),
    ("mi355x", "nvfp4", "TP4/EP4", 1, "TP4/EP4 on MI355X"),
    ("gb300", "nvfp4", "TP4/EP4", 1, "TP4/EP4 on 4x GB300 with SP"),
])
def test_816b_proposal_is_the_smallest_power_of_two_that_fits_with_headroom(device, fmt, label, nodes, recipe):
    """The proposal: the smallest power of two where every rank fits (weights + KV for 8192 tokens within
    90% of a device) with its weights within 75% of the device (PROPOSAL_WEIGHT_SHARE). That is the
    published recipe for four of the five; Quark MXFP4's TP8 on MI355X is a throughput choice beyond it
    (every recipe's mesh fits: next test). Half the proposal either does not fit or leaves too little room."""
    from musecore.planning_mesh import PROPOSAL_WEIGHT_SHARE
    p = musecore.plan(BIG, device, emulate=True, checkpoint_format=fmt)
    m = p.proposed_mesh
    assert not p.fits and p.mesh is None and m is not None
    assert (m.label, m.nodes, m.fits) == (label, nodes, True), (m.label, m.nodes, m.rank_bytes / GiB, recipe)
    half = musecore.plan(BIG, device, emulate=True, checkpoint_format=fmt, tp=m.world // 2, ep=m.world // 2)
    device_bytes = half.mesh.usable_bytes / 0.9
    assert not half.fits or half.mesh.weight_bytes > PROPOSAL_WEIGHT_SHARE * device_bytes, \
        f"{half.mesh.label} fits with headroom ({half.mesh.weight_bytes / GiB:.1f} GiB of weights): not the smallest"
    assert f"proposed mesh: {label} over {m.world} ranks" in str(p)


@pytest.mark.parametrize("device,fmt,tp,sp", [("h200", "nvfp4", 8, False), ("h200", "bf16", 16, False),
                                              ("mi355x", "mxfp4", 8, False), ("mi355x", "nvfp4", 4, False),
                                              ("gb300", "nvfp4", 4, True)])
def test_816b_published_recipes_fit_per_rank(device, fmt, tp, sp):
    p = musecore.plan(BIG, device, emulate=True, checkpoint_format=fmt, tp=tp, ep=tp, sp=sp)
    assert p.fits and p.mesh.fits, (p.mesh.label, p.mesh.rank_bytes / GiB, p.mesh.usable_bytes / GiB)
    assert p.mesh.nodes == (2 if tp == 16 else 1) and p.proposed_mesh is None


def test_proposal_says_why_smaller_meshes_were_passed_over():
    p = musecore.plan(BIG, "h200", emulate=True, checkpoint_format="nvfp4")
    assert p.proposed_mesh.label == "TP8/EP8"
    assert any("TP4/EP4 on 4 devices fits, but its weights take" in line for line in str(p).splitlines()), str(p)


def test_a_model_that_fits_gets_no_proposal_and_a_cpu_host_gets_none():
    assert musecore.plan("muse-tiny", "cpu").proposed_mesh is None
    p = musecore.plan(BIG, "xeon", emulate=True)
    assert not p.fits and p.proposed_mesh is None
    assert any("share its memory" in n for n in p.notes), p.notes


def test_plan_mesh_traffic_is_collective_bytes_for_one_decode_token_and_the_prefill():
    from musecore.config import MuseConfig
    p = musecore.plan(BIG, "h200", emulate=True, checkpoint_format="nvfp4", tp=8, ep=8, sp=True)
    cfg = MuseConfig.from_name(BIG)
    assert p.mesh.decode == collective_bytes(cfg, Mesh(8, 8, sp=True), 1, 2)
    assert p.mesh.prefill == collective_bytes(cfg, Mesh(8, 8, sp=True), p.kv_context, 2)
    assert p.mesh.prefill["all_to_all"] > 0 and p.mesh.decode["reduce_scatter"] == 0


# -- CLI and bad meshes -----------------------------------------------------------------------------

def test_plan_cli_tp_ep_sp_flags(capsys):
    assert main(["plan", "--model", "muse-tiny", "--device", "cpu", "--tp", "2", "--ep", "2", "--sp", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    mesh = out["mesh"]
    assert (mesh["tp"], mesh["ep"], mesh["sp"], mesh["world"], mesh["nodes"], mesh["label"]) == \
        (2, 2, True, 2, 1, "TP2/EP2/SP"), mesh
    assert set(mesh["decode"]) == set(COLLECTIVES) and mesh["fits"] and out["proposed_mesh"] is None
    main(["plan", "--model", "muse-tiny", "--device", "cpu", "--json"])
    assert json.loads(capsys.readouterr().out)["mesh"] is None
    main(["plan", "--model", "muse-tiny", "--device", "cpu", "--ep", "2"])
    text = capsys.readouterr().out
    assert "mesh: TP1/EP2 over 2 ranks" in text and "bytes rank 0 sends per token" in text, text[-2000:]
    main(["plan", "--model", BIG, "--device", "h200", "--emulate", "--json"])
    proposed = json.loads(capsys.readouterr().out)["proposed_mesh"]
    assert (proposed["label"], proposed["nodes"], proposed["devices_per_node"]) == ("TP16/EP16", 2, 8), proposed


@pytest.mark.parametrize("flags,expected", [
    (["--tp", "3"], "tp=3 does not divide the 4 query heads"),
    (["--tp", "2", "--ep", "5"], "ep=5 does not divide"),
    (["--sp"], "sp=True needs tp > 1"),
    (["--tp", "0"], "tp must be a positive integer"),
    (["--tp", "2", "--ep", "4"], "tp=2 must be 1 or the world size (4)"),
])
def test_bad_mesh_is_a_one_line_cli_error(flags, expected, capsys):
    code = main(["plan", "--model", "muse-tiny", "--device", "cpu", *flags])
    err = capsys.readouterr().err
    assert code == 2, (code, err)
    assert err.count("\n") == 1 and expected in err, err
    assert "tp in {1, 2, 4}" in err, err  # what to pass instead


def test_bad_mesh_raises_mesh_error_from_the_api():
    with pytest.raises(MeshError, match="tp=3 does not divide"):
        musecore.plan("muse-tiny", "cpu", tp=3)
    assert musecore.plan("muse-tiny", "cpu", tp=1, ep=1).mesh is None  # one rank: no mesh
