// FLARE_INLINE: a lambda inlined at every call, as __forceinline__ does for functions:
//     auto f = [&](auto& frag) FLARE_INLINE { ... };
// A kernel's lambdas that take or capture register fragments must be: one left out of line (the
// compiler's choice once it is called from a few sites) takes the fragments' addresses, and they
// move to local memory (the Hopper forward's consumer, session 50: a 1.4-1.9 KB stack frame).
#pragma once

#define FLARE_INLINE __attribute__((always_inline))
