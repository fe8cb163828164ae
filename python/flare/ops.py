"""The torch.library side of flare's ops: fake (meta) implementations, so torch.compile traces
through them without running a kernel, and the autograd formula of the attention forward.

The ops themselves (torch.ops.flare.fwd, bwd, merge_states, decode, kda_fwd, kda_recurrent,
kda_recurrent_inplace) are defined and implemented in C++ (csrc/flare_ops.cpp); the schemas there
are the reference for the arguments.
"""

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import _C  # noqa: F401  (loading it registers torch.ops.flare.*)

_C_loaded = _C  # kept by name: the import is for its side effect

_f32 = torch.float32
_Tensor = torch.Tensor
_is_compiling = torch.compiler.is_compiling


def eager(x):
    """Whether a call on x (and tensors like it) may skip the dispatcher and call the op's C++
    implementation directly (flare._C.fwd, decode, merge_states), which saves the dispatcher's
    per-call cost: x is a plain tensor (not a FakeTensor or another subclass), no dispatch mode
    (FakeTensorMode, a profiler's mode) is active and torch.compile is not tracing. Callers also
    take the op when autograd has to see the call."""
    return type(x) is _Tensor and not _is_compiling() and _get_current_dispatch_mode() is None


def eager_autograd(name, impl, setup_context, backward):
    """The op's autograd formula (its register_autograd setup_context and backward) around its C++
    implementation `impl`, as a torch.autograd.Function's apply: what an eager call that autograd must
    see runs instead of the op. The op's torch.library autograd wrapper costs host time per call
    that grows with the schema (it fills every argument's default; flex_fwd's 25 arguments took about
    0.4 ms a call on the H100's host, longer than the kernel on some masks)."""

    def forward(ctx, *inputs):
        output = impl(*inputs)
        setup_context(ctx, inputs, output)
        return output

    fn = type(name, (torch.autograd.Function,), {"forward": staticmethod(forward), "backward": staticmethod(backward)})
    return fn.apply


# ---- fake implementations: shapes and dtypes only, mirroring csrc/flare_ops.cpp -----------------


@torch.library.register_fake("flare::fwd")
def _fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sinks, softmax_scale, causal,
              window_left, window_right, softcap, deterministic):
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    out = q.new_empty(q.shape)
    if varlen:
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=_f32)
    else:
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=_f32)
    return out, lse


@torch.library.register_fake("flare::bwd")
def _bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sinks,
              softmax_scale, causal, window_left, window_right, softcap, deterministic):
    dsinks = sinks.new_empty(sinks.shape) if sinks is not None else q.new_empty((0,), dtype=_f32)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


@torch.library.register_fake("flare::merge_states")
def _merge_states_fake(partial_out, partial_lse, out_dtype):
    shape = partial_out.shape[:-2] + partial_out.shape[-1:]
    out = partial_out.new_empty(shape, dtype=out_dtype if out_dtype is not None else partial_out.dtype)
    return out, partial_out.new_empty(partial_out.shape[:-2], dtype=_f32)


@torch.library.register_fake("flare::decode")
def _decode_fake(q, k_cache, v_cache, cache_seqlens, page_table, workspace, softmax_scale, causal, window_left,
                 num_splits, return_lse):
    lse_shape = (q.shape[0], q.shape[2], q.shape[1]) if return_lse else (0,)
    return q.new_empty(q.shape), q.new_empty(lse_shape, dtype=_f32)


# The chunked forward and the functional recurrent step take the same arguments and give the same
# outputs: (out like v in q's dtype, the final states fp32 [N, HV, K, V] or empty).
@torch.library.register_fake("flare::kda_fwd")
@torch.library.register_fake("flare::kda_recurrent")
def _kda_fwd_fake(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, qk_l2norm, beta_sigmoid,
                  allow_neg_eigval, gate_in_kernel, lower_bound, output_final_state):
    num_seqs = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else q.shape[0]
    out = v.new_empty(v.shape, dtype=q.dtype)
    if output_final_state:
        state = q.new_empty((num_seqs, v.shape[2], q.shape[3], v.shape[3]), dtype=_f32)
    else:
        state = q.new_empty((0,), dtype=_f32)
    return out, state


@torch.library.register_fake("flare::kda_bwd")
def _kda_bwd_fake(dout, q, k, v, g, beta, A_log, dt_bias, initial_state, d_final_state, cu_seqlens, scale, qk_l2norm,
                  beta_sigmoid, allow_neg_eigval, gate_in_kernel, lower_bound):
    none = q.new_empty((0,), dtype=_f32)
    dh0 = initial_state.new_empty(initial_state.shape) if initial_state is not None else none
    dA_log = A_log.new_empty(A_log.shape) if gate_in_kernel and A_log is not None else none
    ddt_bias = dt_bias.new_empty(dt_bias.shape) if gate_in_kernel and dt_bias is not None else none
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), g.new_empty(g.shape),
            beta.new_empty(beta.shape), dh0, dA_log, ddt_bias)


def _kda_fwd_setup_context(ctx, inputs, output):
    (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, qk_l2norm, beta_sigmoid, allow_neg_eigval,
     gate_in_kernel, lower_bound, output_final_state) = inputs
    ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens)
    ctx.params = (scale, qk_l2norm, beta_sigmoid, allow_neg_eigval, gate_in_kernel, lower_bound, output_final_state)


def _kda_fwd_backward(ctx, dout, d_final_state):
    q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens = ctx.saved_tensors
    scale, qk_l2norm, beta_sigmoid, allow_neg_eigval, gate_in_kernel, lower_bound, output_final_state = ctx.params
    if dout is None:  # only the final state was used
        dout = torch.zeros(v.shape, dtype=q.dtype, device=q.device)
    if not output_final_state or d_final_state is None or d_final_state.numel() == 0:
        d_final_state = None
    run = _C.kda_bwd if eager(dout) else torch.ops.flare.kda_bwd
    dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias = run(
        dout, q, k, v, g, beta, A_log, dt_bias, initial_state, d_final_state, cu_seqlens, scale, qk_l2norm,
        beta_sigmoid, allow_neg_eigval, gate_in_kernel, lower_bound)
    return (dq, dk, dv, dg, dbeta,
            dA_log if dA_log.numel() > 0 else None, ddt_bias if ddt_bias.numel() > 0 else None,
            dh0 if initial_state is not None else None,
            None, None, None, None, None, None, None, None)


torch.library.register_autograd("flare::kda_fwd", _kda_fwd_backward, setup_context=_kda_fwd_setup_context)
kda_fwd_eager_autograd = eager_autograd("FlareKdaFwd", _C.kda_fwd, _kda_fwd_setup_context, _kda_fwd_backward)


@torch.library.register_fake("flare::kda_recurrent_inplace")
def _kda_recurrent_inplace_fake(q, k, v, g, beta, A_log, dt_bias, state, state_indices, cu_seqlens, scale, qk_l2norm,
                                beta_sigmoid, allow_neg_eigval, gate_in_kernel, lower_bound):
    return v.new_empty(v.shape, dtype=q.dtype)


# ---- autograd: the attention forward's backward is flare::bwd ------------------------------------

_FWD_TENSOR_ARGS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")


def _fwd_setup_context(ctx, inputs, output):
    (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sinks, softmax_scale, causal, window_left,
     window_right, softcap, deterministic) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, sinks)
    ctx.params = (max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
                  deterministic)
    ctx.mark_non_differentiable(lse)


def _fwd_backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, sinks = ctx.saved_tensors
    (max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
     deterministic) = ctx.params
    if dout is None:  # only the LSE was used, which is not differentiable
        dout = torch.zeros_like(out)
    run = _C.bwd if eager(dout) else torch.ops.flare.bwd
    dq, dk, dv, dsinks = run(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sinks,
                             softmax_scale, causal, window_left, window_right, softcap, deterministic)
    return (dq, dk, dv, None, None, None, None, dsinks if sinks is not None else None, None, None, None, None, None,
            None)


torch.library.register_autograd("flare::fwd", _fwd_backward, setup_context=_fwd_setup_context)
fwd_eager_autograd = eager_autograd("FlareFwd", _C.fwd, _fwd_setup_context, _fwd_backward)
