// Worker output: every line a worker writes is printed on the driver's stdout prefixed
// `[rank]<stdout>:` or `[rank]<stderr>:`, one whole line per write, so lines of different
// workers never interleave; and mirrored per slot under an output directory.
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
  void Feed(const std::string& slot, int stream, const char* data, size_t n,
            const std::string& label);
  // The stream ended: prints what is left of a last unterminated line.
  void Finish(const std::string& slot, int stream, const std::string& label);

 private:
  void Emit(const std::string& slot, int stream, const std::string& line, const std::string& label);
  FILE* MirrorFile(const std::string& slot, int stream);

  FILE* out_;
  std::string output_dir_;
  std::map<std::pair<std::string, int>, std::string> partial_;
  std::map<std::pair<std::string, int>, FILE*> mirrors_;
};

}  // namespace elastic::driver
