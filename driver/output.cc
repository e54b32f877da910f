#include "driver/output.h"

#include <sys/stat.h>

namespace elastic::driver {
namespace {
constexpr size_t kMaxLine = 64 * 1024;  // a longer line is split, never held without bound
}

OutputMux::OutputMux(FILE* out, std::string output_dir)
    : out_(out), output_dir_(std::move(output_dir)) {}

OutputMux::~OutputMux() {
  for (auto& [k, f] : mirrors_) {
    if (f) fclose(f);
  }
}

namespace {
std::string SlotFile(const std::string& root, const std::string& slot, int stream, int mode) {
  std::string dir_name = slot;
  for (char& c : dir_name) {
    if (c == ':' || c == '/') c = '_';
  }
  std::string dir = root + "/" + dir_name;
  mkdir(root.c_str(), static_cast<mode_t>(mode));
  mkdir(dir.c_str(), static_cast<mode_t>(mode));
  return dir + (stream == 1 ? "/stdout" : "/stderr");
}
}  // namespace

std::string OutputMux::WorkerFile(const std::string& slot, int stream) {
  if (files_dir().empty()) return "";
  return SlotFile(files_dir(), slot, stream, output_dir_.empty() ? 0700 : 0755);
}

FILE* OutputMux::MirrorFile(const std::string& slot, int stream) {
  if (output_dir_.empty()) return nullptr;
  auto key = std::make_pair(slot, stream);
  auto it = mirrors_.find(key);
  if (it != mirrors_.end()) return it->second;
  FILE* f = fopen(SlotFile(output_dir_, slot, stream, 0755).c_str(), "a");
  mirrors_[key] = f;  // may be null: mirroring is best-effort
  return f;
}

void OutputMux::Emit(const std::string& slot, int stream, const std::string& line,
                     const std::string& label, bool mirror) {
  std::string text = "[" + label + "]<" + (stream == 1 ? "stdout" : "stderr") + ">:" + line + "\n";
  fwrite(text.data(), 1, text.size(), out_);
  fflush(out_);
  if (!mirror) return;
  if (FILE* f = MirrorFile(slot, stream)) {
    fwrite(line.data(), 1, line.size(), f);
    fputc('\n', f);
    fflush(f);
  }
}

void OutputMux::Feed(const std::string& slot, int stream, const char* data, size_t n,
                     const std::string& label, bool in_file) {
  const bool mirror = !in_file;
  std::string& buf = partial_[{slot, stream}];
  buf.append(data, n);
  size_t start = 0;
  while (true) {
    size_t nl = buf.find('\n', start);
    if (nl == std::string::npos) break;
    Emit(slot, stream, buf.substr(start, nl - start), label, mirror);
    start = nl + 1;
  }
  buf.erase(0, start);
  while (buf.size() >= kMaxLine) {
    Emit(slot, stream, buf.substr(0, kMaxLine), label, mirror);
    buf.erase(0, kMaxLine);
  }
}

void OutputMux::Finish(const std::string& slot, int stream, const std::string& label,
                       bool in_file) {
  auto it = partial_.find({slot, stream});
  if (it == partial_.end()) return;
  if (!it->second.empty()) Emit(slot, stream, it->second, label, !in_file);
  partial_.erase(it);
}

}  // namespace elastic::driver
