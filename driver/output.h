// Worker output: every line a worker writes is printed on the driver's stdout prefixed
// `[rank]<stdout>:` or `[rank]<stderr>:`, one whole line per write, so lines of different
// workers never interleave; and kept per slot in files: local workers write their own
// (WorkerFile: under --output-dir, else under the driver's spool folder), which the driver
// follows and which outlive it; lines that come through pipes (remote workers) are mirrored
// under --output-dir.
#pragma once

#include <cstdio>
#include <map>
#include <string>
#include <utility>

namespace elastic::driver {

class OutputMux {
 public:
  // `out`: where prefixed lines go. `output_dir`: mirror directory ("" for none).
  OutputMux(FILE* out, std::string output_dir);
  ~OutputMux();
  // Bytes from `slot`'s stream (1 stdout, 2 stderr); complete lines are printed with `label`.
  // `in_file`: the bytes were read from the slot's WorkerFile, so they are not mirrored.
  void Feed(const std::string& slot, int stream, const char* data, size_t n,
            const std::string& label, bool in_file = false);
  // Where a local worker of `slot` writes `stream` itself: <dir>/<slot, ':' and '/' as
  // '_'>/stdout or stderr, <dir> being the output directory or else `spool_dir`; the slot's
  // folder is made (0700 under the spool). "" with neither.
  std::string WorkerFile(const std::string& slot, int stream);
  // The folder for worker files when there is no output directory (made by the caller, 0700).
  void SetSpoolDir(std::string dir) { spool_dir_ = std::move(dir); }
  const std::string& files_dir() const { return output_dir_.empty() ? spool_dir_ : output_dir_; }
  // The stream ended: prints what is left of a last unterminated line (`in_file` as Feed).
  void Finish(const std::string& slot, int stream, const std::string& label,
              bool in_file = false);
  // Bytes of `slot`'s stream fed but not printed yet (a line without its end so far).
  size_t Pending(const std::string& slot, int stream) const {
    auto it = partial_.find({slot, stream});
    return it == partial_.end() ? 0 : it->second.size();
  }

 private:
  void Emit(const std::string& slot, int stream, const std::string& line, const std::string& label,
            bool mirror);
  FILE* MirrorFile(const std::string& slot, int stream);

  FILE* out_;
  std::string output_dir_;
  std::string spool_dir_;
  std::map<std::pair<std::string, int>, std::string> partial_;
  std::map<std::pair<std::string, int>, FILE*> mirrors_;
};

}  // namespace elastic::driver
