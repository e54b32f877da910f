// page_touch_bench: what the first touch of a page of a fresh shared-memory mapping costs on
// this machine, against later touches, with and without MAP_POPULATE. Every round change maps
// a new segment for the shared-memory allreduce (ShmGroup) in every local rank, and each rank
// then touches a few hundred of its pages in its first allreduce.
//
//   build/bench/page_touch_bench [MiB]     (default 8: the segment of 63 local ranks)
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace {

double Micros(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  const size_t bytes = (argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 8) << 20;
  const size_t pages = bytes / 4096;
  const std::string name = "/elastic-page-touch-" + std::to_string(getpid());
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(bytes)) != 0 ||
      posix_fallocate(fd, 0, static_cast<off_t>(bytes)) != 0) {
    std::perror("shm");
    return 1;
  }
  shm_unlink(name.c_str());
  std::printf("page_touch_bench: %zu MiB of /dev/shm, one byte read per 4 KiB page; "
              "microseconds per page\n", bytes >> 20);
  std::printf("%-22s %10s %12s %12s %10s\n", "mapping", "mmap", "first read", "second read",
              "munmap");
  for (int populate = 0; populate < 2; ++populate) {
    auto t0 = std::chrono::steady_clock::now();
    char* p = static_cast<char*>(mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                                      MAP_SHARED | (populate ? MAP_POPULATE : 0), fd, 0));
    if (p == MAP_FAILED) {
      std::perror("mmap");
      return 1;
    }
    double map_us = Micros(t0);
    double read_us[2];
    volatile long sink = 0;
    for (double& r : read_us) {
      t0 = std::chrono::steady_clock::now();
      for (size_t i = 0; i < bytes; i += 4096) sink = sink + p[i];
      r = Micros(t0);
    }
    t0 = std::chrono::steady_clock::now();
    munmap(p, bytes);
    double unmap_us = Micros(t0);
    std::printf("%-22s %10.2f %12.2f %12.2f %10.2f\n",
                populate ? "MAP_SHARED|POPULATE" : "MAP_SHARED", map_us / pages,
                read_us[0] / pages, read_us[1] / pages, unmap_us / pages);
  }
  close(fd);
  return 0;
}
