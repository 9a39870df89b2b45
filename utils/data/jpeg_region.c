/* Decode one rectangle of a JPEG with libjpeg(-turbo), built and loaded by utils/jpeg_region.py.
 *
 * A mosaic shows only part of each tile. Rows below the rectangle are never decoded, rows above it are
 * skipped without the inverse DCT and colour conversion, and columns outside it are cropped, so the work
 * is a fraction of decoding the whole file. The pixels equal those of a whole decode (same library, same
 * integer IDCT and fancy upsampling); the tests check this against OpenCV.
 */
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>

enum { REGION_OK = 0, REGION_BROKEN = 1, REGION_UNSUPPORTED = 2 };

struct guard {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
};

static void on_error(j_common_ptr cinfo) { longjmp(((struct guard *)cinfo->err)->jump, 1); }

/* Warnings (corrupt data, premature end) are counted, never printed: the caller falls back. */
static void on_message(j_common_ptr cinfo, int level) {
    if (level < 0) cinfo->err->num_warnings++;
}

static unsigned read16(const JOCTET *p, int little) { return little ? p[0] | p[1] << 8 : p[0] << 8 | p[1]; }

static unsigned read32(const JOCTET *p, int little) {
    return little ? (unsigned)p[0] | (unsigned)p[1] << 8 | (unsigned)p[2] << 16 | (unsigned)p[3] << 24
                  : (unsigned)p[0] << 24 | (unsigned)p[1] << 16 | (unsigned)p[2] << 8 | (unsigned)p[3];
}

/* EXIF orientation (1-8) of an APP1 segment, 1 when it is not EXIF, 0 when it is EXIF but unreadable. */
static int exif_orientation(const JOCTET *seg, unsigned len) {
    if (len < 6 || memcmp(seg, "Exif\0\0", 6) != 0) return 1;
    const JOCTET *tiff = seg + 6;
    unsigned n = len - 6;
    if (n < 8 || !((tiff[0] == 'I' && tiff[1] == 'I') || (tiff[0] == 'M' && tiff[1] == 'M'))) return 0;
    int little = tiff[0] == 'I';
    unsigned ifd = read32(tiff + 4, little);  /* any value: it comes from the file */
    if (ifd >= n || n - ifd < 2) return 0;
    unsigned count = read16(tiff + ifd, little);
    for (unsigned i = 0; i < count; i++) {
        size_t entry = (size_t)ifd + 2 + 12 * (size_t)i;
        if (entry + 12 > n) return 0;
        if (read16(tiff + entry, little) == 0x0112) {
            unsigned value = read16(tiff + entry + 8, little);
            return read16(tiff + entry + 2, little) == 3 && value >= 1 && value <= 8 ? (int)value : 0;
        }
    }
    return 1;
}

/* Decode columns [x0, x1) of rows [y0, y1) of the JPEG in data into out (BGR, rows out_stride bytes apart).
 * width and height are the size the caller expects. REGION_UNSUPPORTED: another size, an EXIF orientation
 * other than 1 (the stored pixels are not the displayed ones) or a colour space other than YCbCr, RGB and
 * grey; REGION_BROKEN: an error or warning while decoding. The caller decodes the whole file then. */
int decode_region(const unsigned char *data, unsigned long size, int width, int height, int x0, int y0, int x1,
                  int y1, unsigned char *out, long out_stride) {
    struct jpeg_decompress_struct cinfo;
    struct guard err;
    unsigned char *volatile row = NULL;
    volatile int status = REGION_OK;

    if (x0 < 0 || y0 < 0 || x1 > width || y1 > height || x1 <= x0 || y1 <= y0) return REGION_UNSUPPORTED;
    memset(&cinfo, 0, sizeof cinfo);  /* jpeg_destroy_decompress is safe on it whenever an error jumps back */
    cinfo.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = on_error;
    err.pub.emit_message = on_message;
    if (setjmp(err.jump)) {
        jpeg_destroy_decompress(&cinfo);
        free(row);
        return REGION_BROKEN;
    }
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, data, size);
    jpeg_save_markers(&cinfo, JPEG_APP0 + 1, 0xFFFF);
    jpeg_read_header(&cinfo, TRUE);

    int orientation = 1;
    for (jpeg_saved_marker_ptr m = cinfo.marker_list; m != NULL && orientation == 1; m = m->next)
        orientation = exif_orientation(m->data, m->data_length);
    if (orientation != 1 || (int)cinfo.image_width != width || (int)cinfo.image_height != height ||
        (cinfo.jpeg_color_space != JCS_YCbCr && cinfo.jpeg_color_space != JCS_RGB &&
         cinfo.jpeg_color_space != JCS_GRAYSCALE)) {
        jpeg_destroy_decompress(&cinfo);
        return REGION_UNSUPPORTED;
    }
    cinfo.out_color_space = JCS_EXT_BGR;
    jpeg_start_decompress(&cinfo);

    /* One spare column each side: the edge columns of a cropped scanline lack a chroma neighbour when
     * upsampling, so they may differ from a whole decode; the spare ones are decoded but not copied. */
    JDIMENSION xoff = x0 > 0 ? x0 - 1 : 0, xwidth = (x1 < width ? x1 + 1 : width) - xoff;
    jpeg_crop_scanline(&cinfo, &xoff, &xwidth);
    row = malloc((size_t)xwidth * 3);
    if (row == NULL) longjmp(err.jump, 1);
    JSAMPROW rows[1] = {row};
    if (y0 > 0 && jpeg_skip_scanlines(&cinfo, (JDIMENSION)y0) != (JDIMENSION)y0) status = REGION_BROKEN;
    size_t n = (size_t)(x1 - x0) * 3;
    for (int y = y0; y < y1 && status == REGION_OK; y++) {
        if (jpeg_read_scanlines(&cinfo, rows, 1) != 1) status = REGION_BROKEN;
        else memcpy(out + (size_t)(y - y0) * out_stride, row + ((size_t)x0 - xoff) * 3, n);
    }
    if (err.pub.num_warnings) status = REGION_BROKEN;
    jpeg_abort_decompress(&cinfo);  /* the rows below are not needed */
    jpeg_destroy_decompress(&cinfo);
    free(row);
    return status;
}
