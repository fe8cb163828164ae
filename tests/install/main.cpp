// A C++ engine linking the installed flare through find_package(flare): built by .ci/run.
#include <flare/attention.h>
#include <cstdio>
int main() {
  flare::AttentionForwardParams p;  // nothing given: the first rule names q
  flare::Status s = flare::attention_forward(p);
  std::printf("%s\n", s.message().c_str());
  return s.ok() ? 1 : 0;
}
