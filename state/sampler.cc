#include <algorithm>
#include <random>

#include "state/state.h"

namespace elastic {

ElasticSampler::ElasticSampler(int64_t num_samples, bool shuffle, uint64_t seed)
    : num_samples_(num_samples), shuffle_(shuffle), seed_(seed) {
  if (num_samples_ < 0) num_samples_ = 0;
  BuildPermutation();
}

void ElasticSampler::BuildPermutation() {
  perm_.resize(static_cast<size_t>(num_samples_));
  for (int64_t i = 0; i < num_samples_; ++i) perm_[i] = i;
  if (shuffle_) {
    std::mt19937_64 rng(seed_ + static_cast<uint64_t>(epoch_));
    // Fisher-Yates with our own draw, so the order is the same on every platform.
    for (int64_t i = num_samples_ - 1; i > 0; --i) {
      int64_t j = static_cast<int64_t>(rng() % static_cast<uint64_t>(i + 1));
      std::swap(perm_[i], perm_[j]);
    }
  }
}

void ElasticSampler::SetRank(int rank, int size) {
  rank_ = rank;
  size_ = std::max(size, 1);
}

void ElasticSampler::SetEpoch(int64_t epoch) {
  epoch_ = epoch;
  cursor_ = 0;
  BuildPermutation();
}

ElasticSampler::Batch ElasticSampler::Next(int batch_per_rank, int64_t global_batch) {
  Batch b;
  if (num_samples_ == 0 || batch_per_rank <= 0) return b;
  int64_t per_step = static_cast<int64_t>(batch_per_rank) * size_;
  if (global_batch > 0) per_step = std::min(per_step, global_batch);
  int64_t end = std::min(num_samples_, cursor_ + per_step);
  for (int j = 0; j < batch_per_rank; ++j) {
    int64_t pos = cursor_ + rank_ + static_cast<int64_t>(j) * size_;
    bool pad = pos >= end;
    // A short rank repeats an index of this step's range so every rank takes the same count.
    int64_t real = pad ? cursor_ + (pos - cursor_) % std::max<int64_t>(end - cursor_, 1) : pos;
    b.indices.push_back(perm_[static_cast<size_t>(std::min(real, num_samples_ - 1))]);
    b.padding.push_back(pad);
  }
  cursor_ = end;
  return b;
}

std::string ElasticSampler::Serialize() const {
  int64_t v[2] = {epoch_, cursor_};
  return std::string(reinterpret_cast<const char*>(v), sizeof v);
}

Status ElasticSampler::Deserialize(const std::string& bytes) {
  int64_t v[2];
  if (bytes.size() != sizeof v) return InvalidArgument("sampler state has the wrong size");
  std::memcpy(v, bytes.data(), sizeof v);
  if (v[1] < 0 || v[1] > num_samples_) return InvalidArgument("sampler cursor out of range");
  if (v[0] != epoch_) {
    epoch_ = v[0];
    BuildPermutation();
  }
  cursor_ = v[1];
  return Status::Ok();
}

}  // namespace elastic
