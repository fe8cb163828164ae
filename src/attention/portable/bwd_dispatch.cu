#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

#include "src/attention/portable/bwd_config.h"
#include "src/attention/portable/bwd_launch.h"
#include "src/attention/portable/head_dims.h"

namespace flare::portable {

BwdBlocks portable_bwd_blocks(int head_dim) {
  if (instantiated_head_dim(head_dim) == 0) return {};
  return visit_head_dim(head_dim, [](auto d) {
    using Cfg = typename BwdConfigFor<decltype(d)::value>::type;
    return BwdBlocks{Cfg::kBlockM, Cfg::kBlockN, decltype(d)::value};
  });
}

Status portable_attention_backward(const detail::BwdKernelParams& p, DType dtype, Stream stream) {
  return visit_instantiation(p.fwd.head_dim, dtype, [&](auto hd, auto elem) {
    return launch_portable_bwd<decltype(hd)::value, decltype(elem)>(p, stream);
  });
}

Status portable_attention_backward_sparse(const detail::BwdKernelParams& p, const block_sparse::BlockSparseParams& bs,
                                          const block_sparse::DqPlanView* plan, DType dtype, Stream stream) {
  return visit_instantiation(p.fwd.head_dim, dtype, [&](auto hd, auto elem) {
    return launch_portable_bwd_sparse<decltype(hd)::value, decltype(elem)>(p, bs, plan, stream);
  });
}

}  // namespace flare::portable
