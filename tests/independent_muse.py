"""A second, independent implementation of MODEL.md section 1, for testing the real graph.

Written straight from the spec in a different style (one function, float64, explicit per-token
and per-head loops where the graph uses fused ops) and sharing no code with ``musecore``.
"""

import math

import torch


def _rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):
    d = x.shape[-1]
    inv = torch.tensor([theta ** (-2 * i / d) for i in range(d // 2)], dtype=torch.float64)
    ang = pos[:, None].double() * inv[None, :]
    ang = torch.cat([ang, ang], -1)  # [T,d]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    rot = torch.cat([-x2, x1], -1)
    return x * cos + rot * sin


def muse_logits(t: dict, cfg: dict, ids: list[int]) -> torch.Tensor:
    """Logits [T,V] for one sequence, float64. ``t``: checkpoint tensors; ``cfg``: config.json dict."""
    g = lambda name: t[name].double()  # noqa: E731
    P = "model.language_model."
    H, L, eps = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["rms_norm_eps"]
    nq, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    k_top, W = cfg["num_experts_per_tok"], cfg["sliding_window"]
    T = len(ids)
    pos = torch.arange(T)
    x = g(P + "embed_tokens.weight")[torch.tensor(ids)]  # [T,H]
    for i in range(L):
        p = f"{P}layers.{i}."
        kind = cfg["layer_types"][i]
        theta = cfg["rope_parameters"][kind]["rope_theta"]
        a = _rms(x, g(p + "input_layernorm.weight"), eps)
        q = (a @ g(p + "self_attn.q_proj.weight").T).view(T, nq, d)
        k = (a @ g(p + "self_attn.k_proj.weight").T).view(T, nkv, d)
        v = (a @ g(p + "self_attn.v_proj.weight").T).view(T, nkv, d)
        q = _rope(_rms(q, g(p + "self_attn.q_norm.weight"), eps), pos, theta)
        k = _rope(_rms(k, g(p + "self_attn.k_norm.weight"), eps), pos, theta)
        o = torch.zeros(T, nq, d, dtype=torch.float64)
        for h in range(nq):
            kh = h // (nq // nkv)
            for qi in range(T):
                lo = qi - W + 1 if kind == "sliding_attention" else 0
                keys = list(range(max(lo, 0), qi + 1))
                s = torch.stack([q[qi, h] @ k[j, kh] for j in keys]) / math.sqrt(d)
                pr = torch.softmax(s, 0)
                o[qi, h] = sum(pr[n] * v[j, kh] for n, j in enumerate(keys))
        gate = torch.sigmoid(a @ g(p + "self_attn.gate_proj.weight").T)  # [T,nq]
        o = _rms(o, g(p + "self_attn.o_norm.weight"), eps) * gate[..., None]
        attn = o.reshape(T, nq * d) @ g(p + "self_attn.o_proj.weight").T
        h_ = x + g(p + "attn_residual_gate") * _rms(attn, g(p + "post_attention_layernorm.weight"), eps)
        m = _rms(h_, g(p + "pre_feedforward_layernorm.weight"), eps)
        probs = torch.softmax(m @ g(p + "mlp.router.weight").T, -1)
        z = _rms(m @ g(p + "mlp.fc1_latent_proj.weight").T, g(p + "mlp.latent_norm.weight"), eps)
        y = torch.zeros(T, z.shape[-1], dtype=torch.float64)
        for ti in range(T):
            w, sel = torch.topk(probs[ti], k_top)
            w = w / w.sum()
            for wj, e in zip(w, sel.tolist()):
                q_ = f"{p}mlp.experts.{e}."
                hid = torch.nn.functional.silu(z[ti] @ g(q_ + "gate_proj.weight").T) * (z[ti] @ g(q_ + "up_proj.weight").T)
                out = hid @ g(q_ + "down_proj.weight").T
                y[ti] += wj * _rms(out, g(q_ + "output_norm.weight"), eps)
        u = y @ g(p + "mlp.fc2_latent_proj.weight").T
        x = h_ + g(p + "ffn_residual_gate") * _rms(u, g(p + "post_feedforward_layernorm.weight"), eps)
    return _rms(x, g(P + "norm.weight"), eps) @ g("lm_head.weight").T
