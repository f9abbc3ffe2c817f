// What the AMX kernels share: whether this build has the tile instructions, the tile
// configuration's memory layout, the process's permission to use the tile registers, and each
// kernel's switch between its tiles and its vector code.
#pragma once

#include <atomic>

#include "cpu_math.h"

#if defined(MMSERVE_BF16_DOT) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define MMSERVE_AMX 1
#endif

#ifdef MMSERVE_AMX
namespace mmserve_cpu {

// LDTILECFG's 64 bytes: palette 1, then each tile register's bytes a row and rows.
struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux hands out the tile registers' state to a process that asks (arch_prctl
// ARCH_REQ_XCOMP_PERM for XTILEDATA); a tile instruction before that is an illegal
// instruction. Asked once; false where the kernel refuses.
inline bool amx_permitted() {
  static const bool permitted = [] {
    constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

}  // namespace mmserve_cpu
#endif

namespace mmserve_cpu {

// A kernel's choice between its AMX tiles and its vector code: the tiles where the build has
// them and the OS lets the process use them, unless turned off (tests do, to run the vector
// code on an AMX CPU).
class AmxSwitch {
 public:
  // Built with AMX and permitted.
  bool supported() const {
#ifdef MMSERVE_AMX
    return amx_permitted();
#else
    return false;
#endif
  }
  bool on() const { return enabled_.load() && supported(); }
  // Turns the tiles on or off where supported; the previous setting (false without AMX).
  bool set(bool enabled) {
#ifdef MMSERVE_AMX
    return enabled_.exchange(enabled);
#else
    (void)enabled;
    return false;
#endif
  }

 private:
  std::atomic<bool> enabled_{true};
};

}  // namespace mmserve_cpu
