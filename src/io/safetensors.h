// A minimal, defensive safetensors reader: 8-byte little-endian header length, a JSON header of
// {name: {dtype, shape, data_offsets}} (+ optional "__metadata__"), then the data buffer. Every
// length, offset, size and dtype is checked before any tensor byte is read; tensors are read on
// demand from the file (the file is never mapped or loaded whole).
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "fp4moe/types.h"

namespace fp4moe::safetensors {

struct TensorInfo {
  std::string name;
  std::string dtype_name;   // as in the file: "BF16", "F32", ...
  size_t elem_size = 0;     // bytes per element of dtype_name
  bool has_dtype = false;   // dtype_name maps onto an fp4moe DType
  DType dtype = DType::U8;  // valid when has_dtype
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte offsets inside the data buffer
  int64_t numel() const;
};

class File {
 public:
  // Opens and validates `path`. NotFound when it cannot be opened; InvalidArgument (argument "path",
  // message naming the file and the problem) when it is malformed.
  static File open(const std::string& path);
  // Validates an in-memory file image (tests, embedded data).
  static File from_bytes(std::vector<uint8_t> bytes, const std::string& origin = "<memory>");

  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const TensorInfo* find(const std::string& name) const;  // nullptr when absent
  const std::string& origin() const { return origin_; }

  // The tensor's raw little-endian bytes (end - begin of them).
  std::vector<uint8_t> read(const TensorInfo& t) const;
  // Its elements converted to bf16 bits: BF16 as is, F32 and F16 rounded to nearest even.
  // Other dtypes are refused naming the tensor.
  std::vector<uint16_t> read_bf16(const TensorInfo& t) const;

 private:
  std::string origin_;
  std::vector<uint8_t> image_;  // whole file for from_bytes; empty for open()
  uint64_t file_size_ = 0;
  uint64_t data_start_ = 0;     // 8 + header length
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;

  void parse_header(const std::string& header);
};

// Writes a safetensors file (tests and tools). Tensors are written in the given order, contiguously.
struct WriteTensor {
  std::string name;
  std::string dtype_name;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};
void write_file(const std::string& path, const std::vector<WriteTensor>& tensors,
                const std::map<std::string, std::string>& metadata = {});

}  // namespace fp4moe::safetensors
