#include "state/checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>

#include "common/folder_lock.h"
#include "common/mutex.h"

namespace elastic {
namespace {

constexpr size_t kMaxManifestBytes = 16u << 20;
constexpr size_t kMaxManifestFiles = 100000;
constexpr size_t kIoChunk = 8u << 20;

std::string Errno(const std::string& what, const std::string& path) {
  return what + " " + path + ": " + std::strerror(errno);
}

std::string VersionFolder(int64_t version) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "v%020lld", static_cast<long long>(version));
  return buf;
}

// A folder name v<20 digits>: its version, or -1.
int64_t VersionOf(const std::string& name) {
  if (name.size() != 21 || name[0] != 'v') return -1;
  int64_t v = 0;
  for (size_t i = 1; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return -1;
    if (v > (INT64_MAX - 9) / 10) return -1;
    v = v * 10 + (name[i] - '0');
  }
  return v;
}

std::vector<std::string> Entries(const std::string& dir) {
  std::vector<std::string> out;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return out;
  while (dirent* e = readdir(d)) {
    std::string n = e->d_name;
    if (n != "." && n != "..") out.push_back(n);
  }
  closedir(d);
  return out;
}

void RemoveTree(const std::string& path) {
  struct stat st {};
  if (lstat(path.c_str(), &st) != 0) return;
  if (S_ISDIR(st.st_mode)) {
    for (const auto& n : Entries(path)) RemoveTree(path + "/" + n);
    rmdir(path.c_str());
  } else {
    unlink(path.c_str());
  }
}

Status FsyncPath(const std::string& path) {
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Internal(Errno("cannot open", path));
  int rc = fsync(fd);
  int err = errno;
  close(fd);
  errno = err;
  return rc == 0 ? Status::Ok() : Internal(Errno("cannot fsync", path));
}

Status WriteFile(const std::string& path, const char* data, size_t size, uint32_t* crc) {
  int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return Internal(Errno("cannot create", path));
  uLong c = crc32(0L, Z_NULL, 0);
  for (size_t off = 0; off < size;) {
    ssize_t w = write(fd, data + off, std::min(kIoChunk, size - off));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      Status s = Internal(Errno("cannot write", path));
      close(fd);
      return s;
    }
    c = crc32(c, reinterpret_cast<const Bytef*>(data + off), static_cast<uInt>(w));
    off += static_cast<size_t>(w);
  }
  if (fsync(fd) != 0) {
    Status s = Internal(Errno("cannot fsync", path));
    close(fd);
    return s;
  }
  if (close(fd) != 0) return Internal(Errno("cannot close", path));
  *crc = static_cast<uint32_t>(c);
  return Status::Ok();
}

Status ReadWhole(const std::string& path, size_t limit, std::string* out) {
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return NotFound(Errno("cannot open", path));
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return InvalidArgument(path + " is not a regular file");
  }
  if (static_cast<uint64_t>(st.st_size) > limit) {
    close(fd);
    return InvalidArgument(path + " has " + std::to_string(st.st_size) +
                           " bytes, over the limit of " + std::to_string(limit));
  }
  out->assign(static_cast<size_t>(st.st_size), '\0');
  size_t off = 0;
  while (off < out->size()) {
    ssize_t r = read(fd, &(*out)[off], std::min(kIoChunk, out->size() - off));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      Status s = Internal(r == 0 ? path + " ended early" : Errno("cannot read", path));
      close(fd);
      return s;
    }
    off += static_cast<size_t>(r);
  }
  close(fd);
  return Status::Ok();
}

bool SafeFileName(const std::string& n) {
  if (n.empty() || n == "." || n == ".." || n == "manifest.json") return false;
  return n.find('/') == std::string::npos && n.find('\0') == std::string::npos;
}

}  // namespace

std::string CheckpointFileName(const std::string& kind, const std::string& name) {
  static const char* hex = "0123456789ABCDEF";
  std::string out = kind + ".";
  for (unsigned char c : name) {
    if (std::isalnum(c) || c == '.' || c == '_' || c == '-') {
      out += static_cast<char>(c);
    } else {
      out += '%';
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  return out;
}

Status WriteCheckpoint(const std::string& dir, const CheckpointInfo& meta,
                       const std::vector<CheckpointFile>& files, int keep,
                       CheckpointInfo* written) {
  if (mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return Internal(Errno("cannot create the checkpoint folder", dir));
  }
  std::string final_path = dir + "/" + VersionFolder(meta.version);
  std::string tmp = dir + "/.tmp-" + VersionFolder(meta.version) + "-" + std::to_string(getpid());
  RemoveTree(tmp);
  if (mkdir(tmp.c_str(), 0700) != 0) return Internal(Errno("cannot create", tmp));
  CheckpointInfo info = meta;
  info.files.clear();
  nlohmann::json manifest = {{"format", "elastic-run checkpoint 1"},
                             {"version", meta.version},
                             {"step", meta.step},
                             {"epoch", meta.epoch},
                             {"cursor", meta.cursor},
                             {"samples", meta.samples},
                             {"world_size", meta.world_size},
                             {"time", meta.time}};
  nlohmann::json list = nlohmann::json::array();
  for (const auto& f : files) {
    CheckpointEntry e{f.name, f.kind, CheckpointFileName(f.kind, f.name), f.size, 0};
    Status s = WriteFile(tmp + "/" + e.file, f.data, f.size, &e.crc32);
    if (!s.ok()) {
      RemoveTree(tmp);
      return s;
    }
    list.push_back({{"name", e.name}, {"kind", e.kind}, {"file", e.file}, {"size", e.size},
                    {"crc32", e.crc32}});
    info.files.push_back(std::move(e));
  }
  manifest["files"] = std::move(list);
  std::string text = manifest.dump(1) + "\n";
  uint32_t crc = 0;
  Status s = WriteFile(tmp + "/manifest.json", text.data(), text.size(), &crc);
  if (s.ok()) s = FsyncPath(tmp);
  if (s.ok()) {
    RemoveTree(final_path);  // an older write of the same version (a restarted job)
    if (rename(tmp.c_str(), final_path.c_str()) != 0) {
      s = Internal(Errno("cannot rename " + tmp + " to", final_path));
    }
  }
  if (s.ok()) s = FsyncPath(dir);
  if (!s.ok()) {
    RemoveTree(tmp);
    return s;
  }
  info.path = final_path;
  // Keep the newest `keep` complete versions; older ones (and this one's superseded copies) go.
  std::vector<std::pair<int64_t, std::string>> versions;
  for (const auto& n : Entries(dir)) {
    int64_t v = VersionOf(n);
    if (v >= 0) versions.emplace_back(v, n);
  }
  std::sort(versions.rbegin(), versions.rend());
  int kept = 0;
  for (const auto& [v, n] : versions) {
    CheckpointInfo other;
    bool complete = ReadManifest(dir + "/" + n, &other).ok();
    if (complete && kept < std::max(1, keep)) {
      ++kept;
    } else if (v < meta.version) {
      RemoveTree(dir + "/" + n);
    }
  }
  if (written) *written = std::move(info);
  return Status::Ok();
}

Status ReadManifest(const std::string& folder, CheckpointInfo* out) {
  std::string text;
  Status s = ReadWhole(folder + "/manifest.json", kMaxManifestBytes, &text);
  if (!s.ok()) return s;
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  std::string m = folder + "/manifest.json";
  if (j.is_discarded() || !j.is_object()) return InvalidArgument(m + " is not JSON");
  try {
    if (j.value("format", "") != "elastic-run checkpoint 1") {
      return InvalidArgument(m + " is not an elastic-run checkpoint manifest");
    }
    CheckpointInfo info;
    info.version = j.at("version").get<int64_t>();
    info.step = j.at("step").get<int64_t>();
    info.epoch = j.at("epoch").get<int64_t>();
    info.cursor = j.at("cursor").get<int64_t>();
    info.samples = j.at("samples").get<int64_t>();
    info.world_size = j.at("world_size").get<int64_t>();
    info.time = j.at("time").get<double>();
    info.path = folder;
    const auto& files = j.at("files");
    if (!files.is_array() || files.size() > kMaxManifestFiles) {
      return InvalidArgument(m + ": 'files' is not a list of at most " +
                             std::to_string(kMaxManifestFiles));
    }
    for (const auto& f : files) {
      CheckpointEntry e;
      e.name = f.at("name").get<std::string>();
      e.kind = f.at("kind").get<std::string>();
      e.file = f.at("file").get<std::string>();
      e.size = f.at("size").get<uint64_t>();
      e.crc32 = f.at("crc32").get<uint32_t>();
      if (!SafeFileName(e.file)) return InvalidArgument(m + ": bad file name '" + e.file + "'");
      struct stat st {};
      std::string p = folder + "/" + e.file;
      if (stat(p.c_str(), &st) != 0) return NotFound(m + " lists " + e.file + ", which is missing");
      if (static_cast<uint64_t>(st.st_size) != e.size) {
        return InvalidArgument(p + " has " + std::to_string(st.st_size) + " bytes, the manifest says " +
                               std::to_string(e.size) + " (truncated?)");
      }
      info.files.push_back(std::move(e));
    }
    *out = std::move(info);
    return Status::Ok();
  } catch (const std::exception& e) {
    return InvalidArgument(m + ": " + e.what());
  }
}

Status ReadCheckpointFile(const CheckpointInfo& info, const CheckpointEntry& entry,
                          std::string* out) {
  std::string p = info.path + "/" + entry.file;
  if (entry.size > (uint64_t{1} << 40)) return InvalidArgument(p + ": size over 1 TiB");
  Status s = ReadWhole(p, static_cast<size_t>(entry.size), out);
  if (!s.ok()) return s;
  if (out->size() != entry.size) {
    return InvalidArgument(p + " has " + std::to_string(out->size()) + " bytes, the manifest says " +
                           std::to_string(entry.size));
  }
  uLong c = crc32(0L, Z_NULL, 0);
  for (size_t o = 0; o < out->size();) {
    size_t n = std::min(kIoChunk, out->size() - o);
    c = crc32(c, reinterpret_cast<const Bytef*>(out->data() + o), static_cast<uInt>(n));
    o += n;
  }
  if (static_cast<uint32_t>(c) != entry.crc32) {
    return InvalidArgument(p + ": checksum mismatch (the file is corrupt)");
  }
  return Status::Ok();
}

std::vector<CheckpointInfo> ListCheckpoints(const std::string& dir,
                                            std::vector<std::string>* skipped) {
  std::vector<std::pair<int64_t, std::string>> versions;
  for (const auto& n : Entries(dir)) {
    int64_t v = VersionOf(n);
    if (v >= 0) versions.emplace_back(v, n);
  }
  std::sort(versions.rbegin(), versions.rend());
  std::vector<CheckpointInfo> out;
  for (const auto& [v, n] : versions) {
    CheckpointInfo info;
    Status s = ReadManifest(dir + "/" + n, &info);
    if (s.ok() && info.version != v) {
      s = InvalidArgument(dir + "/" + n + "/manifest.json says version " +
                          std::to_string(info.version));
    }
    if (!s.ok()) {
      if (skipped) skipped->push_back(s.message());
      continue;
    }
    out.push_back(std::move(info));
  }
  return out;
}

void RemoveUnfinishedCheckpoints(const std::string& dir) {
  for (const auto& n : Entries(dir)) {
    if (n.rfind(".tmp-", 0) == 0) RemoveTree(dir + "/" + n);
  }
}

StatusOr<int> LockCheckpointDir(const std::string& dir) {
  return LockFolder(dir, "checkpoint folder", "is in use by another job",
                    "give each job its own --checkpoint-dir");
}

Checkpointer::Checkpointer(Options options, Done done)
    : options_(std::move(options)), done_(std::move(done)) {
  thread_ = std::thread([this] { Loop(); });
}

Checkpointer::~Checkpointer() {
  {
    MutexLock g(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

bool Checkpointer::Due() const {
  MutexLock g(mu_);
  if (busy_) return false;
  return !last_start_ || std::chrono::steady_clock::now() - *last_start_ >= options_.interval;
}

bool Checkpointer::Submit(CheckpointInfo meta, std::vector<CheckpointFile> files) {
  {
    MutexLock g(mu_);
    if (busy_ || stop_) return false;
    busy_ = true;
    last_start_ = std::chrono::steady_clock::now();
    meta_ = std::move(meta);
    files_ = std::move(files);
  }
  cv_.notify_all();
  return true;
}

bool Checkpointer::Wait(std::chrono::duration<double> timeout) {
  MutexLock l(mu_);
  return cv_.wait_for(l.native(), timeout, [this]() ELASTIC_REQUIRES(mu_) { return !busy_; });
}

void Checkpointer::Loop() {
  while (true) {
    CheckpointInfo meta;
    std::vector<CheckpointFile> files;
    {
      MutexLock l(mu_);
      cv_.wait(l.native(), [this]() ELASTIC_REQUIRES(mu_) { return stop_ || busy_; });
      if (!busy_) return;  // stop, nothing pending
      meta = meta_;
      files = std::move(files_);
    }
    auto t0 = std::chrono::steady_clock::now();
    CheckpointInfo written;
    Status s = WriteCheckpoint(options_.dir, meta, files, options_.keep, &written);
    files.clear();  // the snapshot's buffers go back to the state before anyone is told
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (done_) done_(s, s.ok() ? written : meta, secs);
    {
      MutexLock g(mu_);
      busy_ = false;
    }
    cv_.notify_all();
  }
}

}  // namespace elastic
