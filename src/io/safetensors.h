#pragma once
// safetensors: a memory-mapped, zero-copy reader that validates everything before handing out a
// pointer, and an atomic writer (temporary file + rename). Format: 8-byte little-endian header
// length N, N bytes of JSON {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__":
// {str: str}}, then the data; offsets are relative to the end of the header.
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace quads::io {

enum class DType : uint8_t { BOOL, U8, I8, U16, I16, F16, BF16, U32, I32, F32, U64, I64, F64, F8_E4M3, F8_E5M2 };

size_t dtype_size(DType d);
const char* dtype_name(DType d);          // the safetensors spelling: "F32", "BF16", "F8_E4M3", ...
bool parse_dtype(const std::string& s, DType* out);

struct TensorView {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;  // points into the mapping; valid while the file object lives
  size_t nbytes = 0;
  int64_t numel() const;
  // Converts F32/F16/BF16/F64 (and integer types) to float32; throws naming the tensor otherwise.
  std::vector<float> to_f32() const;
};

class SafeTensorsFile {
 public:
  // Maps and validates `path`; throws quads::Error naming the file (and the tensor) on any defect:
  // short file, header length beyond the file or above 100 MB, bad JSON, unknown dtype, shape
  // and dtype inconsistent with the byte range, offsets out of range, overlapping or leaving gaps.
  static std::shared_ptr<SafeTensorsFile> open(const std::string& path);
  ~SafeTensorsFile();

  const std::string& path() const { return path_; }
  const std::vector<TensorView>& tensors() const { return tensors_; }
  const TensorView* find(const std::string& name) const;  // nullptr if absent
  const TensorView& at(const std::string& name) const;     // throws naming file and tensor
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  SafeTensorsFile() = default;
  std::string path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  std::vector<TensorView> tensors_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// A tensor to write: owns its bytes.
struct TensorData {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
  // float32 data stored as F32, BF16 or F16 (rounded to nearest even via numerics/formats).
  static TensorData from_f32(std::string name, std::vector<int64_t> shape, const float* data, DType dtype = DType::F32);
  static TensorData raw(std::string name, DType dtype, std::vector<int64_t> shape, const void* data, size_t nbytes);
};

// Writes tensors sorted by name (as the Python library does) with the header padded with spaces
// to a multiple of 8 bytes; writes `path`.tmp.<pid> and renames it over `path`.
void write_safetensors(const std::string& path, const std::vector<TensorData>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// Writes `data` to `path` atomically (temporary file in the same folder, fsync, rename).
void write_file_atomic(const std::string& path, const void* data, size_t n);

}  // namespace quads::io
