#include "common/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace elastic {

Status WriteFileAtomically(const std::string& path, const std::string& text, mode_t mode) {
  std::string tmp = path + ".tmp";
  auto fail = [&](const std::string& what) {
    Status s = Internal(what + ": " + strerror(errno));
    unlink(tmp.c_str());
    return s;
  };
  int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode);
  if (fd < 0) return Internal("cannot write " + tmp + ": " + strerror(errno));
  size_t done = 0;
  while (done < text.size()) {
    ssize_t n = write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      Status s = fail("cannot write " + tmp);
      close(fd);
      return s;
    }
    done += static_cast<size_t>(n);
  }
  close(fd);
  if (rename(tmp.c_str(), path.c_str()) != 0) return fail("cannot rename " + tmp + " to " + path);
  return Status::Ok();
}

}  // namespace elastic
