// The instruction-set cap of the run-time dispatch (kernels.h).
#include <algorithm>
#include <atomic>

#include "kernels.h"

namespace specengine {
namespace {
std::atomic<int> g_isa_cap{kIsaAmx};
}  // namespace

void set_isa_cap(int level) { g_isa_cap.store(std::clamp(level, kIsaGeneric, kIsaAmx)); }

int isa_cap() { return g_isa_cap.load(std::memory_order_relaxed); }

}  // namespace specengine
