#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "common/error.h"
#include "numerics/formats.h"

static_assert(std::endian::native == std::endian::little, "safetensors is little-endian; so is every host we build for");

namespace quads::io {

namespace {

constexpr uint64_t kMaxHeader = 100'000'000;  // the Python/Rust library's bound

struct DTypeInfo {
  DType dtype;
  const char* name;
  size_t size;
  int rust_rank;  // position in the Rust crate's Dtype enum: the writer sorts by it, descending
};

// Ranks follow safetensors' Rust enum (BOOL, F4, F6_E2M3, F6_E3M2, U8, I8, F8_E5M2, F8_E4M3,
// F8_E8M0, I16, U16, F16, BF16, I32, U32, F32, C64, F64, I64, U64), which fixes the order in
// which Python lays out tensors of equal element size.
constexpr DTypeInfo kDTypes[] = {
    {DType::BOOL, "BOOL", 1, 0},        {DType::U8, "U8", 1, 4},       {DType::I8, "I8", 1, 5},
    {DType::U16, "U16", 2, 10},         {DType::I16, "I16", 2, 9},     {DType::F16, "F16", 2, 11},
    {DType::BF16, "BF16", 2, 12},       {DType::U32, "U32", 4, 14},    {DType::I32, "I32", 4, 13},
    {DType::F32, "F32", 4, 15},         {DType::U64, "U64", 8, 19},    {DType::I64, "I64", 8, 18},
    {DType::F64, "F64", 8, 17},         {DType::F8_E4M3, "F8_E4M3", 1, 7},
    {DType::F8_E5M2, "F8_E5M2", 1, 6},  {DType::F8_E8M0, "F8_E8M0", 1, 8},
};

const DTypeInfo& info(DType d) {
  auto i = static_cast<size_t>(d);
  QUADS_CHECK(i < std::size(kDTypes), "invalid dtype value {}", i);
  return kDTypes[i];
}

// numel and byte count of a shape, or false on overflow (of size_t or of int64).
bool shape_bytes(const std::vector<int64_t>& shape, size_t elsize, uint64_t* numel, uint64_t* nbytes) {
  uint64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return false;
    if (d == 0) { n = 0; break; }
  }
  if (n != 0)
    for (int64_t d : shape)
      if (__builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) return false;
  if (n > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
  uint64_t b;
  if (__builtin_mul_overflow(n, static_cast<uint64_t>(elsize), &b)) return false;
  if (b > std::numeric_limits<size_t>::max()) return false;
  *numel = n;
  *nbytes = b;
  return true;
}

// Printable form of a name taken from a possibly corrupt header (control bytes escaped, long
// names cut) so that error messages stay one readable line.
std::string printable(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (out.size() > 200) { out += "..."; break; }
    if (c < 0x20 || c == 0x7f) out += fmt::format("\\x{:02x}", c);
    else out += static_cast<char>(c);
  }
  return out;
}

bool valid_utf8(const std::string& s) {
  size_t i = 0, n = s.size();
  while (i < n) {
    auto c = static_cast<unsigned char>(s[i]);
    int len;
    uint32_t cp;
    if (c < 0x80) { ++i; continue; }
    else if ((c & 0xE0) == 0xC0) { len = 2; cp = c & 0x1F; }
    else if ((c & 0xF0) == 0xE0) { len = 3; cp = c & 0x0F; }
    else if ((c & 0xF8) == 0xF0) { len = 4; cp = c & 0x07; }
    else return false;
    if (i + len > n) return false;
    for (int k = 1; k < len; ++k) {
      auto cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && (cp < 0x10000 || cp > 0x10FFFF)) ||
        (cp >= 0xD800 && cp <= 0xDFFF))
      return false;
    i += len;
  }
  return true;
}

// JSON string as serde_json writes it (the Python library's serializer): escapes only '"', '\\'
// and control characters, short forms for \b \f \n \r \t, lowercase \u00XX for the rest.
void append_json_string(std::string& out, const std::string& s) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) out += fmt::format("\\u{:04x}", c);
        else out += static_cast<char>(c);
    }
  }
  out += '"';
}

std::string errno_str() { return std::strerror(errno); }

void write_all(int fd, const void* data, size_t n, uint64_t offset, const std::string& path) {
  auto p = static_cast<const uint8_t*>(data);
  while (n > 0) {
    size_t chunk = std::min<size_t>(n, size_t(1) << 30);
    ssize_t w = ::pwrite(fd, p, chunk, static_cast<off_t>(offset));
    if (w < 0) {
      if (errno == EINTR) continue;
      fail("{}: write failed: {}", path, errno_str());
    }
    QUADS_CHECK(w > 0, "{}: write made no progress (disk full?)", path);
    p += w;
    n -= static_cast<size_t>(w);
    offset += static_cast<uint64_t>(w);
  }
}

std::string temp_path_for(const std::string& path) {
  static std::atomic<unsigned> counter{0};
  return fmt::format("{}.tmp.{}.{}", path, static_cast<long>(::getpid()), counter.fetch_add(1));
}

void fsync_parent_dir(const std::string& path) {
  auto slash = path.rfind('/');
  std::string dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);  // best effort: some file systems refuse fsync on directories
    ::close(dfd);
  }
}

}  // namespace

size_t dtype_size(DType d) { return info(d).size; }
const char* dtype_name(DType d) { return info(d).name; }

bool parse_dtype(const std::string& s, DType* out) {
  for (const auto& t : kDTypes)
    if (s == t.name) {
      *out = t.dtype;
      return true;
    }
  return false;
}

std::string shape_str(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

// ---------------------------------------------------------------------------------------------
// TensorView

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // validated at open: cannot overflow
  return n;
}

namespace {
template <typename T>
void convert(const uint8_t* src, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    T v;
    std::memcpy(&v, src + i * sizeof(T), sizeof(T));
    out[i] = static_cast<float>(v);
  }
}
}  // namespace

void TensorView::to_f32(float* out) const {
  const int64_t n = numel();
  switch (dtype) {
    case DType::F32: std::memcpy(out, data, n * sizeof(float)); break;
    case DType::F64: convert<double>(data, n, out); break;
    case DType::F16:
    case DType::BF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t b;
        std::memcpy(&b, data + 2 * i, 2);
        out[i] = dtype == DType::F16 ? num::f16_to_f32(b) : num::bf16_to_f32(b);
      }
      break;
    case DType::BOOL:
      for (int64_t i = 0; i < n; ++i) out[i] = data[i] ? 1.f : 0.f;
      break;
    case DType::U8: convert<uint8_t>(data, n, out); break;
    case DType::I8: convert<int8_t>(data, n, out); break;
    case DType::U16: convert<uint16_t>(data, n, out); break;
    case DType::I16: convert<int16_t>(data, n, out); break;
    case DType::U32: convert<uint32_t>(data, n, out); break;
    case DType::I32: convert<int32_t>(data, n, out); break;
    case DType::U64: convert<uint64_t>(data, n, out); break;
    case DType::I64: convert<int64_t>(data, n, out); break;
    case DType::F8_E4M3: for (int64_t i = 0; i < n; ++i) out[i] = num::e4m3_to_f32(data[i]); break;
    case DType::F8_E5M2: for (int64_t i = 0; i < n; ++i) out[i] = num::e5m2_to_f32(data[i]); break;
    case DType::F8_E8M0: for (int64_t i = 0; i < n; ++i) out[i] = num::ue8m0_to_f32(data[i]); break;
    default: fail("tensor '{}': cannot convert dtype {} to float32", name, dtype_name(dtype));
  }
}

std::vector<float> TensorView::to_f32() const {
  std::vector<float> out(static_cast<size_t>(numel()));
  to_f32(out.data());
  return out;
}

// ---------------------------------------------------------------------------------------------
// Reader

std::shared_ptr<SafeTensorsFile> SafeTensorsFile::open(const std::string& path) {
  std::shared_ptr<SafeTensorsFile> f(new SafeTensorsFile());
  f->path_ = path;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  QUADS_CHECK(fd >= 0, "{}: cannot open: {}", path, errno_str());
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    std::string e = errno_str();
    ::close(fd);
    fail("{}: cannot stat: {}", path, e);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail("{}: not a regular file", path);
  }
  size_t size = static_cast<size_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    fail("{}: file too short for a safetensors header ({} bytes, need at least 8)", path, size);
  }
  void* m = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  std::string e = errno_str();
  ::close(fd);
  QUADS_CHECK(m != MAP_FAILED, "{}: mmap of {} bytes failed: {}", path, size, e);
  f->map_ = m;
  f->map_size_ = size;
  f->parse();
  return f;
}

std::shared_ptr<SafeTensorsFile> SafeTensorsFile::from_bytes(const std::string& label, const void* data, size_t n) {
  std::shared_ptr<SafeTensorsFile> f(new SafeTensorsFile());
  f->path_ = label;
  f->owned_.assign(static_cast<const uint8_t*>(data), static_cast<const uint8_t*>(data) + n);
  f->map_size_ = n;
  f->map_ = f->owned_.data();
  f->parse();
  return f;
}

SafeTensorsFile::~SafeTensorsFile() {
  if (map_ && owned_.empty()) ::munmap(map_, map_size_);
}

void SafeTensorsFile::parse() {
  using json = nlohmann::json;
  const auto* p = static_cast<const uint8_t*>(map_);
  const size_t size = map_size_;
  QUADS_CHECK(size >= 8, "{}: file too short for a safetensors header ({} bytes, need at least 8)", path_, size);
  uint64_t n;
  std::memcpy(&n, p, 8);
  QUADS_CHECK(n <= kMaxHeader, "{}: header length {} is above the 100 MB limit (corrupt length field?)", path_, n);
  QUADS_CHECK(n <= size - 8, "{}: header length {} runs past the end of the file ({} bytes)", path_, n, size);
  header_size_ = n;
  const char* h = reinterpret_cast<const char*>(p + 8);

  // nlohmann keeps the last of duplicate keys silently; a duplicated tensor name is a corrupt
  // file, so keys are checked as they are parsed. The depth bound stops absurd nesting early:
  // a valid header is an object of objects holding flat arrays.
  std::vector<std::set<std::string>> keys;
  auto cb = [&](int depth, json::parse_event_t ev, json& parsed) {
    if (depth > 3) fail("{}: header nests deeper than a safetensors header can", path_);
    if (ev == json::parse_event_t::object_start) keys.emplace_back();
    else if (ev == json::parse_event_t::object_end) keys.pop_back();
    else if (ev == json::parse_event_t::key && !keys.empty()) {
      const auto& k = parsed.get_ref<const std::string&>();
      if (!keys.back().insert(k).second) {
        if (keys.size() == 1) fail("{}: tensor '{}' appears twice in the header", path_, printable(k));
        fail("{}: key '{}' appears twice in one header object", path_, printable(k));
      }
    }
    return true;
  };
  json j;
  try {
    j = json::parse(h, h + n, cb, /*allow_exceptions=*/true, /*ignore_comments=*/false);
  } catch (const json::exception& e) {
    fail("{}: header is not valid JSON: {}", path_, e.what());
  }
  QUADS_CHECK(j.is_object(), "{}: header is a JSON {}, not an object", path_, j.type_name());

  const size_t data_size = size - 8 - n;
  const uint8_t* data = p + 8 + n;
  struct Range { size_t begin, end, index; };
  std::vector<Range> ranges;
  tensors_.reserve(j.size());
  for (auto& [name, v] : j.items()) {
    if (name == "__metadata__") {
      if (v.is_null()) continue;  // the Rust reader accepts null as "no metadata"
      QUADS_CHECK(v.is_object(), "{}: __metadata__ is a JSON {}, not an object of strings", path_, v.type_name());
      for (auto& [k, mv] : v.items()) {
        QUADS_CHECK(mv.is_string(), "{}: __metadata__ value of '{}' is a JSON {}, not a string", path_,
                    printable(k), mv.type_name());
        metadata_[k] = mv.get<std::string>();
      }
      continue;
    }
    const std::string pname = printable(name);
    QUADS_CHECK(v.is_object(), "{}: tensor '{}': entry is a JSON {}, not an object", path_, pname, v.type_name());
    for (auto& [k, unused] : v.items())
      QUADS_CHECK(k == "dtype" || k == "shape" || k == "data_offsets", "{}: tensor '{}': unexpected field '{}'", path_,
                  pname, printable(k));
    QUADS_CHECK(v.contains("dtype") && v["dtype"].is_string(), "{}: tensor '{}': missing or non-string dtype", path_, pname);
    TensorView t;
    t.name = name;
    const std::string& dname = v["dtype"].get_ref<const std::string&>();
    QUADS_CHECK(parse_dtype(dname, &t.dtype), "{}: tensor '{}': unknown dtype '{}'", path_, pname, printable(dname));
    QUADS_CHECK(v.contains("shape") && v["shape"].is_array(), "{}: tensor '{}': missing shape array", path_, pname);
    for (auto& d : v["shape"]) {
      QUADS_CHECK(d.is_number_unsigned(), "{}: tensor '{}': shape entry {} is not a non-negative integer", path_, pname,
                  d.dump());
      uint64_t dv = d.get<uint64_t>();
      QUADS_CHECK(dv <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
                  "{}: tensor '{}': shape entry {} is too large", path_, pname, dv);
      t.shape.push_back(static_cast<int64_t>(dv));
    }
    QUADS_CHECK(v.contains("data_offsets") && v["data_offsets"].is_array() && v["data_offsets"].size() == 2,
                "{}: tensor '{}': data_offsets must be an array [begin, end]", path_, pname);
    const auto& off = v["data_offsets"];
    QUADS_CHECK(off[0].is_number_unsigned() && off[1].is_number_unsigned(),
                "{}: tensor '{}': data_offsets {} are not non-negative integers", path_, pname, off.dump());
    uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
    uint64_t numel, nbytes;
    QUADS_CHECK(shape_bytes(t.shape, dtype_size(t.dtype), &numel, &nbytes),
                "{}: tensor '{}': shape {} of {} overflows", path_, pname, shape_str(t.shape), dname);
    QUADS_CHECK(begin <= end, "{}: tensor '{}': data_offsets [{}, {}] end before they begin", path_, pname, begin, end);
    QUADS_CHECK(end - begin == nbytes, "{}: tensor '{}': data_offsets [{}, {}] hold {} bytes but {} {} needs {}",
                path_, pname, begin, end, end - begin, dname, shape_str(t.shape), nbytes);
    QUADS_CHECK(end <= data_size, "{}: tensor '{}': data_offsets [{}, {}] run past the data ({} bytes)", path_, pname,
                begin, end, data_size);
    t.data = data + begin;
    t.nbytes = static_cast<size_t>(nbytes);
    ranges.push_back({static_cast<size_t>(begin), static_cast<size_t>(end), tensors_.size()});
    tensors_.push_back(std::move(t));
  }

  // The data must be tiled exactly: sorted by offset, each tensor starts where the previous one
  // ended, and the last one ends at the end of the file.
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  size_t expect = 0;
  const TensorView* prev = nullptr;
  for (const Range& r : ranges) {
    const TensorView& t = tensors_[r.index];
    if (r.begin < expect)
      fail("{}: tensor '{}': data_offsets [{}, {}] overlap tensor '{}' (which ends at {})", path_, printable(t.name),
           r.begin, r.end, printable(prev->name), expect);
    if (r.begin > expect)
      fail("{}: tensor '{}': data_offsets [{}, {}] leave a gap of {} bytes after {}", path_, printable(t.name), r.begin,
           r.end, r.begin - expect, prev ? "tensor '" + printable(prev->name) + "'" : std::string("the header"));
    expect = r.end;
    prev = &t;
  }
  if (expect != data_size)
    fail("{}: {} bytes after the last tensor{} are not covered by any tensor", path_, data_size - expect,
         prev ? " ('" + printable(prev->name) + "')" : std::string());

  std::vector<TensorView> ordered;
  ordered.reserve(tensors_.size());
  for (const Range& r : ranges) ordered.push_back(std::move(tensors_[r.index]));
  tensors_ = std::move(ordered);
  for (size_t i = 0; i < tensors_.size(); ++i) index_[tensors_[i].name] = i;
}

const TensorView* SafeTensorsFile::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

const TensorView& SafeTensorsFile::at(const std::string& name) const {
  const TensorView* t = find(name);
  QUADS_CHECK(t, "{}: no tensor named '{}'", path_, name);
  return *t;
}

// ---------------------------------------------------------------------------------------------
// Writer

TensorData TensorData::from_f32(std::string name, std::vector<int64_t> shape, const float* data, DType dtype) {
  uint64_t numel, nbytes;
  QUADS_CHECK(shape_bytes(shape, 4, &numel, &nbytes), "tensor '{}': invalid shape {}", name, shape_str(shape));
  TensorData t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  switch (dtype) {
    case DType::F32:
      t.bytes.resize(numel * 4);
      if (numel) std::memcpy(t.bytes.data(), data, numel * 4);
      break;
    case DType::BF16:
    case DType::F16:
      t.bytes.resize(numel * 2);
      for (uint64_t i = 0; i < numel; ++i) {
        uint16_t b = dtype == DType::BF16 ? num::bf16_from_f32(data[i]) : num::f16_from_f32(data[i]);
        std::memcpy(t.bytes.data() + 2 * i, &b, 2);
      }
      break;
    default: fail("tensor '{}': from_f32 writes F32, BF16 or F16, not {}", name, dtype_name(dtype));
  }
  t.name = std::move(name);
  return t;
}

TensorData TensorData::raw(std::string name, DType dtype, std::vector<int64_t> shape, const void* data, size_t nbytes) {
  uint64_t numel, need;
  QUADS_CHECK(shape_bytes(shape, dtype_size(dtype), &numel, &need), "tensor '{}': invalid shape {}", name,
              shape_str(shape));
  QUADS_CHECK(need == nbytes, "tensor '{}': {} bytes given but {} {} needs {}", name, nbytes, dtype_name(dtype),
              shape_str(shape), need);
  TensorData t;
  t.name = std::move(name);
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.bytes.assign(static_cast<const uint8_t*>(data), static_cast<const uint8_t*>(data) + nbytes);
  return t;
}

SafeTensorsWriter::SafeTensorsWriter(const std::string& path, std::vector<TensorSpec> specs,
                                     const std::map<std::string, std::string>& metadata)
    : path_(path) {
  for (const auto& [k, v] : metadata)
    QUADS_CHECK(valid_utf8(k) && valid_utf8(v), "{}: metadata '{}' is not valid UTF-8", path, printable(k));
  for (const auto& s : specs) {
    QUADS_CHECK(!s.name.empty(), "{}: a tensor has an empty name", path);
    QUADS_CHECK(s.name != "__metadata__", "{}: '__metadata__' is reserved and cannot name a tensor", path);
    QUADS_CHECK(valid_utf8(s.name), "{}: tensor name '{}' is not valid UTF-8", path, printable(s.name));
    info(s.dtype);
  }
  std::sort(specs.begin(), specs.end(), [](const TensorSpec& a, const TensorSpec& b) {
    int ra = info(a.dtype).rust_rank, rb = info(b.dtype).rust_rank;
    return ra != rb ? ra > rb : a.name < b.name;
  });

  std::string js = "{";
  if (!metadata.empty()) {
    js += "\"__metadata__\":{";
    bool first = true;
    for (const auto& [k, v] : metadata) {
      if (!first) js += ',';
      first = false;
      append_json_string(js, k);
      js += ':';
      size_t at = js.size();
      append_json_string(js, v);
      meta_pos_[k] = {8 + at, js.size() - at};
    }
    js += '}';
  }
  uint64_t offset = 0;
  for (auto& s : specs) {
    uint64_t numel, nbytes;
    QUADS_CHECK(shape_bytes(s.shape, dtype_size(s.dtype), &numel, &nbytes), "{}: tensor '{}': invalid shape {}", path,
                s.name, shape_str(s.shape));
    QUADS_CHECK(index_.emplace(s.name, slots_.size()).second, "{}: tensor '{}' is given twice", path, s.name);
    if (js.size() > 1) js += ',';
    append_json_string(js, s.name);
    js += fmt::format(":{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{},{}]}}", dtype_name(s.dtype),
                      fmt::join(s.shape, ","), offset, offset + nbytes);
    Slot slot;
    slot.begin = offset;
    slot.end = offset + nbytes;
    slot.written = nbytes == 0;
    slot.spec = std::move(s);
    slots_.push_back(std::move(slot));
    offset += nbytes;
  }
  js += '}';
  js.append((8 - js.size() % 8) % 8, ' ');
  QUADS_CHECK(js.size() <= kMaxHeader, "{}: header of {} bytes is above the 100 MB limit", path, js.size());

  data_start_ = 8 + js.size();
  file_size_ = data_start_ + offset;
  tmp_path_ = temp_path_for(path);
  fd_ = ::open(tmp_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  QUADS_CHECK(fd_ >= 0, "{}: cannot create: {}", tmp_path_, errno_str());
  uint64_t n = js.size();
  try {
    write_all(fd_, &n, 8, 0, tmp_path_);
    write_all(fd_, js.data(), js.size(), 8, tmp_path_);
    // Size the file up front so that tensors can land in any order.
    QUADS_CHECK(::ftruncate(fd_, static_cast<off_t>(file_size_)) == 0, "{}: cannot extend to {} bytes: {}", tmp_path_,
                file_size_, errno_str());
  } catch (...) {
    ::close(fd_);
    ::unlink(tmp_path_.c_str());
    fd_ = -1;
    throw;
  }
}

SafeTensorsWriter::~SafeTensorsWriter() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(tmp_path_.c_str());
  }
}

void SafeTensorsWriter::write(const std::string& name, const void* data, size_t nbytes) {
  QUADS_CHECK(fd_ >= 0, "{}: write of tensor '{}' after commit", path_, name);
  auto it = index_.find(name);
  QUADS_CHECK(it != index_.end(), "{}: tensor '{}' was not declared", path_, name);
  Slot& s = slots_[it->second];
  QUADS_CHECK(nbytes == s.end - s.begin, "{}: tensor '{}': {} bytes given but {} {} needs {}", path_, name, nbytes,
              dtype_name(s.spec.dtype), shape_str(s.spec.shape), s.end - s.begin);
  QUADS_CHECK(!s.written || nbytes == 0, "{}: tensor '{}' written twice", path_, name);
  write_all(fd_, data, nbytes, data_start_ + s.begin, tmp_path_);
  s.written = true;
}

void SafeTensorsWriter::set_metadata(const std::string& key, const std::string& value) {
  QUADS_CHECK(fd_ >= 0, "{}: metadata '{}' set after commit", path_, key);
  auto it = meta_pos_.find(key);
  QUADS_CHECK(it != meta_pos_.end(), "{}: metadata '{}' was not reserved", path_, key);
  QUADS_CHECK(valid_utf8(value), "{}: metadata '{}' is not valid UTF-8", path_, key);
  std::string js;
  append_json_string(js, value);
  QUADS_CHECK(js.size() == it->second.second, "{}: metadata '{}': new value takes {} bytes, the reserved one {}", path_,
              key, js.size(), it->second.second);
  write_all(fd_, js.data(), js.size(), it->second.first, tmp_path_);
}

void SafeTensorsWriter::commit() {
  QUADS_CHECK(fd_ >= 0, "{}: committed twice", path_);
  for (const Slot& s : slots_)
    QUADS_CHECK(s.written, "{}: tensor '{}' was declared but never written", path_, s.spec.name);
  QUADS_CHECK(::fsync(fd_) == 0, "{}: fsync failed: {}", tmp_path_, errno_str());
  int rc = ::close(fd_);
  fd_ = -1;
  if (rc != 0 || ::rename(tmp_path_.c_str(), path_.c_str()) != 0) {
    std::string e = errno_str();
    ::unlink(tmp_path_.c_str());
    fail("{}: cannot move {} into place: {}", path_, tmp_path_, e);
  }
  fsync_parent_dir(path_);
}

void write_safetensors(const std::string& path, const std::vector<TensorData>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::vector<TensorSpec> specs;
  specs.reserve(tensors.size());
  for (const auto& t : tensors) specs.push_back({t.name, t.dtype, t.shape});
  SafeTensorsWriter w(path, std::move(specs), metadata);
  for (const auto& t : tensors) w.write(t.name, t.bytes.data(), t.bytes.size());
  w.commit();
}

void write_file_atomic(const std::string& path, const void* data, size_t n) {
  std::string tmp = temp_path_for(path);
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  QUADS_CHECK(fd >= 0, "{}: cannot create: {}", tmp, errno_str());
  try {
    write_all(fd, data, n, 0, tmp);
    QUADS_CHECK(::fsync(fd) == 0, "{}: fsync failed: {}", tmp, errno_str());
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  int rc = ::close(fd);
  if (rc != 0 || ::rename(tmp.c_str(), path.c_str()) != 0) {
    std::string e = errno_str();
    ::unlink(tmp.c_str());
    fail("{}: cannot move {} into place: {}", path, tmp, e);
  }
  fsync_parent_dir(path);
}

}  // namespace quads::io
