// The in-kernel option variants every KDA GPU test sweeps (forward, backward, recurrent step):
// each sets the options and whether A_log / dt_bias are given, on top of a test's own base case.
#pragma once

#include <string>
#include <vector>

#include "flare/kda.h"

namespace flare::test {

struct KdaOptionCase {
  std::string name;
  KdaOptions options;
  bool A_log = true, dt_bias = true;
};

inline std::vector<KdaOptionCase> kda_option_cases() {
  auto with = [](std::string name, auto set) {
    KdaOptionCase c;
    c.name = std::move(name);
    set(c.options, c);
    return c;
  };
  return {
      with("l2norm", [](KdaOptions& o, KdaOptionCase&) { o.qk_l2norm = true; }),
      with("beta sigmoid", [](KdaOptions& o, KdaOptionCase&) { o.beta_sigmoid = true; }),
      with("neg eigval", [](KdaOptions& o, KdaOptionCase&) { o.beta_sigmoid = o.allow_neg_eigval = true; }),
      with("gate", [](KdaOptions& o, KdaOptionCase&) { o.gate_in_kernel = true; }),
      with("gate, no dt_bias", [](KdaOptions& o, KdaOptionCase& c) { o.gate_in_kernel = true, c.dt_bias = false; }),
      with("gate lower bound", [](KdaOptions& o, KdaOptionCase&) { o.gate_in_kernel = true, o.lower_bound = -5.f; }),
      with("gate lower bound, no A_log",
           [](KdaOptions& o, KdaOptionCase& c) { o.gate_in_kernel = true, o.lower_bound = -5.f, c.A_log = false; }),
      with("scale", [](KdaOptions& o, KdaOptionCase&) { o.scale = 0.3f; }),
      with("layer mode", [](KdaOptions& o, KdaOptionCase&) { o.qk_l2norm = o.beta_sigmoid = o.gate_in_kernel = true; }),
  };
}

// `base` with option case `oc` applied (its name, options, A_log and dt_bias).
template <typename Case>
Case with_option_case(Case base, const KdaOptionCase& oc) {
  base.name = oc.name;
  base.options = oc.options;
  base.A_log = oc.A_log;
  base.dt_bias = oc.dt_bias;
  return base;
}

}  // namespace flare::test
