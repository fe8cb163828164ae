// The KDA forward state passes on wgmma, fp16 (kda_state_gmma.h).
#include "src/kda/kda_state_gmma.sm90.cuh"

FLARE_KDA_STATE_GMMA_INSTANTIATE(__half)
