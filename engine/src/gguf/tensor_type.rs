//! ggml tensor types as stored in GGUF tensor infos.
//!
//! Ids, names, block sizes and bytes per block are those of the pinned llama.cpp:
//! the `ggml_type` enum in ggml.h, the `type_traits` table in ggml.c and the block
//! structs of ggml-common.h (sizes taken with `sizeof` against that header). Ids 4, 5,
//! 31..=33 and 36..=38 were removed upstream and are unknown here.

use std::fmt;

use super::reader::MAX_DIMS;

macro_rules! ggml_types {
    ($($variant:ident = $id:literal, $name:literal, $block:literal, $size:literal;)*) => {
        #[allow(non_camel_case_types)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[repr(u32)]
        pub enum GgmlType { $($variant = $id,)* }

        impl GgmlType {
            pub const ALL: &'static [GgmlType] = &[$(GgmlType::$variant,)*];

            pub fn from_u32(id: u32) -> Option<Self> {
                match id {
                    $($id => Some(GgmlType::$variant),)*
                    _ => None,
                }
            }

            /// ggml's own name (`ggml_type_name`), e.g. "q4_1", "q6_K".
            pub fn name(self) -> &'static str {
                match self { $(GgmlType::$variant => $name,)* }
            }

            /// Elements per block.
            pub fn block_size(self) -> u64 {
                match self { $(GgmlType::$variant => $block,)* }
            }

            /// Bytes per block.
            pub fn type_size(self) -> u64 {
                match self { $(GgmlType::$variant => $size,)* }
            }
        }
    };
}

ggml_types! {
    F32 = 0, "f32", 1, 4;
    F16 = 1, "f16", 1, 2;
    Q4_0 = 2, "q4_0", 32, 18;
    Q4_1 = 3, "q4_1", 32, 20;
    Q5_0 = 6, "q5_0", 32, 22;
    Q5_1 = 7, "q5_1", 32, 24;
    Q8_0 = 8, "q8_0", 32, 34;
    Q8_1 = 9, "q8_1", 32, 36;
    Q2_K = 10, "q2_K", 256, 84;
    Q3_K = 11, "q3_K", 256, 110;
    Q4_K = 12, "q4_K", 256, 144;
    Q5_K = 13, "q5_K", 256, 176;
    Q6_K = 14, "q6_K", 256, 210;
    Q8_K = 15, "q8_K", 256, 292;
    IQ2_XXS = 16, "iq2_xxs", 256, 66;
    IQ2_XS = 17, "iq2_xs", 256, 74;
    IQ3_XXS = 18, "iq3_xxs", 256, 98;
    IQ1_S = 19, "iq1_s", 256, 50;
    IQ4_NL = 20, "iq4_nl", 32, 18;
    IQ3_S = 21, "iq3_s", 256, 110;
    IQ2_S = 22, "iq2_s", 256, 82;
    IQ4_XS = 23, "iq4_xs", 256, 136;
    I8 = 24, "i8", 1, 1;
    I16 = 25, "i16", 1, 2;
    I32 = 26, "i32", 1, 4;
    I64 = 27, "i64", 1, 8;
    F64 = 28, "f64", 1, 8;
    IQ1_M = 29, "iq1_m", 256, 56;
    BF16 = 30, "bf16", 1, 2;
    TQ1_0 = 34, "tq1_0", 256, 54;
    TQ2_0 = 35, "tq2_0", 256, 66;
    MXFP4 = 39, "mxfp4", 32, 17;
    NVFP4 = 40, "nvfp4", 64, 36;
    Q1_0 = 41, "q1_0", 128, 18;
    Q2_0 = 42, "q2_0", 64, 18;
}

impl GgmlType {
    pub fn id(self) -> u32 {
        self as u32
    }

    /// Bytes of a row of `n` elements; None if `n` is not a whole number of blocks
    /// (ggml cannot address a partial block) or the size overflows.
    pub fn row_bytes(self, n: u64) -> Option<u64> {
        if !n.is_multiple_of(self.block_size()) {
            return None;
        }
        (n / self.block_size()).checked_mul(self.type_size())
    }

    /// Bytes of a whole tensor with shape `dims` (ggml `ne` order), or why that shape
    /// is not a valid ggml tensor of this type. Shared by the reader and the writer so
    /// both accept exactly the same shapes.
    pub(crate) fn tensor_bytes(self, dims: &[u64]) -> Result<u64, String> {
        let Some((&ne0, rest)) = dims.split_first().filter(|_| dims.len() <= MAX_DIMS) else {
            return Err(format!(
                "has {} dimensions (expected 1 to {MAX_DIMS})",
                dims.len()
            ));
        };
        if let Some(d) = dims.iter().position(|&n| n == 0) {
            return Err(format!("dimension {d} is 0"));
        }
        // ggml stores ne as i64, so the element count must fit one.
        let fits_i64 = |n: &u64| i64::try_from(*n).is_ok();
        let n_elements = dims
            .iter()
            .try_fold(1u64, |acc, &n| acc.checked_mul(n))
            .filter(fits_i64);
        if n_elements.is_none() {
            return Err(format!("element count of shape {dims:?} overflows"));
        }
        if ne0 % self.block_size() != 0 {
            return Err(format!(
                "row length {ne0} is not a multiple of the {self} block size {}",
                self.block_size()
            ));
        }
        rest.iter()
            .fold(self.row_bytes(ne0), |acc, &n| acc?.checked_mul(n))
            .ok_or_else(|| format!("byte size of shape {dims:?} overflows"))
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_removed_ids_are_unknown() {
        for &ty in GgmlType::ALL {
            assert_eq!(GgmlType::from_u32(ty.id()), Some(ty));
        }
        for removed in [4, 5, 31, 32, 33, 36, 37, 38, 43, 99] {
            assert_eq!(GgmlType::from_u32(removed), None, "id {removed}");
        }
    }

    #[test]
    fn sizes_match_ggml() {
        assert_eq!(
            (GgmlType::Q4_1.block_size(), GgmlType::Q4_1.type_size()),
            (32, 20)
        );
        assert_eq!(
            (GgmlType::Q8_0.block_size(), GgmlType::Q8_0.type_size()),
            (32, 34)
        );
        assert_eq!(
            (GgmlType::Q6_K.block_size(), GgmlType::Q6_K.type_size()),
            (256, 210)
        );
        assert_eq!(GgmlType::Q4_1.row_bytes(576), Some(18 * 20));
        assert_eq!(GgmlType::Q4_1.row_bytes(33), None);
        assert_eq!(GgmlType::F32.row_bytes(3), Some(12));
        assert_eq!(
            GgmlType::Q8_0.tensor_bytes(&[576, 49152]),
            Ok(18 * 34 * 49152)
        );
    }

    #[test]
    fn bad_shapes_are_explained() {
        let err =
            |ty: GgmlType, dims: &[u64]| ty.tensor_bytes(dims).expect_err("shape must be refused");
        assert!(err(GgmlType::F32, &[]).contains("0 dimensions"));
        assert!(err(GgmlType::F32, &[1; 5]).contains("5 dimensions"));
        assert!(err(GgmlType::F32, &[4, 0]).contains("dimension 1 is 0"));
        assert!(err(GgmlType::F32, &[1 << 32, 1 << 32]).contains("overflows"));
        assert!(err(GgmlType::Q4_0, &[48]).contains("not a multiple of the q4_0 block size 32"));
        assert!(err(GgmlType::F64, &[1 << 61, 2]).contains("byte size"));
    }
}
