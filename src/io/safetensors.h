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

// F8_E8M0 (the MX scale format) is not in older safetensors releases; we read and write it so
// that MXFP4 checkpoints that use it load, but our own MXFP4 writer stores its scales as U8.
enum class DType : uint8_t { BOOL, U8, I8, U16, I16, F16, BF16, U32, I32, F32, U64, I64, F64, F8_E4M3, F8_E5M2,
                             F8_E8M0 };

size_t dtype_size(DType d);
const char* dtype_name(DType d);          // the safetensors spelling: "F32", "BF16", "F8_E4M3", ...
bool parse_dtype(const std::string& s, DType* out);

struct TensorView {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  // Points into the mapping; valid while the file object lives. Files we (and the Python library)
  // write keep every tensor 8-byte aligned; other writers may not, so read through memcpy or
  // to_f32 unless the pointer is checked.
  const uint8_t* data = nullptr;
  size_t nbytes = 0;
  int64_t numel() const;
  // Converts F32/F16/BF16/F64, the integer types, BOOL and the FP8 formats (E4M3, E5M2, E8M0)
  // to float32 (integers above 2^24 round to nearest).
  std::vector<float> to_f32() const;
  void to_f32(float* out) const;  // out holds numel() floats
};

class SafeTensorsFile {
 public:
  // Maps and validates `path`; throws quads::Error naming the file (and the tensor) on any defect:
  // short file, header length beyond the file or above 100 MB, bad JSON, unknown dtype, shape
  // and dtype inconsistent with the byte range, offsets out of range, overlapping or leaving gaps.
  static std::shared_ptr<SafeTensorsFile> open(const std::string& path);
  // The same validation on bytes in memory (copied); `label` stands for the file name in errors.
  static std::shared_ptr<SafeTensorsFile> from_bytes(const std::string& label, const void* data, size_t n);
  ~SafeTensorsFile();
  SafeTensorsFile(const SafeTensorsFile&) = delete;
  SafeTensorsFile& operator=(const SafeTensorsFile&) = delete;

  const std::string& path() const { return path_; }
  // In file order (by data offset), which for files written by us or by Python is: larger dtypes
  // first, then by name.
  const std::vector<TensorView>& tensors() const { return tensors_; }
  const TensorView* find(const std::string& name) const;  // nullptr if absent
  const TensorView& at(const std::string& name) const;     // throws naming file and tensor
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  size_t file_size() const { return map_size_; }
  size_t header_size() const { return header_size_; }  // N, the JSON length including padding

 private:
  SafeTensorsFile() = default;
  void parse();
  std::string path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  std::vector<uint8_t> owned_;  // from_bytes keeps its copy here (map_ then points into it)
  size_t header_size_ = 0;
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

// Writes tensors in the order Python's safetensors uses (larger dtypes first, then by name: that
// keeps every tensor aligned to its element size), with the header padded with spaces to a
// multiple of 8 bytes, so that the bytes equal what `safetensors.torch.save_file` writes (for
// metadata of more than one key Python's order is random; we sort keys). Writes
// `path`.tmp.<pid> and renames it over `path`.
void write_safetensors(const std::string& path, const std::vector<TensorData>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// Writes `data` to `path` atomically (temporary file in the same folder, fsync, rename).
void write_file_atomic(const std::string& path, const void* data, size_t n);

// The streaming form of write_safetensors for files larger than memory: the layout is fixed by
// the specs up front, then each tensor's bytes are written (in any order, each exactly once) and
// commit() renames the temporary file into place. Without commit() the destructor removes it.
struct TensorSpec {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
};

class SafeTensorsWriter {
 public:
  SafeTensorsWriter(const std::string& path, std::vector<TensorSpec> specs,
                    const std::map<std::string, std::string>& metadata = {});
  ~SafeTensorsWriter();
  SafeTensorsWriter(const SafeTensorsWriter&) = delete;
  SafeTensorsWriter& operator=(const SafeTensorsWriter&) = delete;

  void write(const std::string& name, const void* data, size_t nbytes);
  // Replaces a metadata value given to the constructor by one of the same JSON-escaped length
  // (for values known only after the data is written: reserve them with a placeholder).
  void set_metadata(const std::string& key, const std::string& value);
  void commit();
  size_t file_size() const { return file_size_; }

 private:
  struct Slot { TensorSpec spec; size_t begin = 0, end = 0; bool written = false; };
  std::string path_, tmp_path_;
  int fd_ = -1;
  size_t data_start_ = 0, file_size_ = 0;
  std::vector<Slot> slots_;  // in file order
  std::map<std::string, size_t> index_;
  std::map<std::string, std::pair<size_t, size_t>> meta_pos_;  // key -> (file offset, length) of the value
};

// "[512, 64]"; "[]" for a scalar.
std::string shape_str(const std::vector<int64_t>& shape);

}  // namespace quads::io
