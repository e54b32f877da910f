#include "common/folder_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace elastic {

StatusOr<int> LockFolder(const std::string& dir, const std::string& what,
                         const std::string& held, const std::string& advice) {
  if (mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return Internal("cannot create the " + what + " " + dir + ": " + strerror(errno));
  }
  std::string path = dir + "/LOCK";
  int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) return Internal("cannot open " + path + ": " + strerror(errno));
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    char buf[64] = {0};
    ssize_t n = pread(fd, buf, sizeof buf - 1, 0);
    close(fd);
    std::string who = n > 0 ? std::string(buf, static_cast<size_t>(n)) : "";
    while (!who.empty() && (who.back() == '\n' || who.back() == ' ')) who.pop_back();
    return FailedPrecondition("the " + what + " " + dir + " " + held +
                              (who.empty() ? "" : " (elastic-run pid " + who + ")") + "; " +
                              advice);
  }
  std::string pid = std::to_string(getpid()) + "\n";
  if (ftruncate(fd, 0) != 0 || pwrite(fd, pid.data(), pid.size(), 0) < 0) {
    // The lock holds without the pid in it; only the message to a second process is poorer.
  }
  return fd;
}

}  // namespace elastic
